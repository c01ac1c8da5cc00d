//! The sandbox holds when the trainer runs as root (as CI does): no privileged identity reaches
//! generated code, it cannot change any file's metadata (mode, owner, timestamps, extended
//! attributes), and it cannot connect to a unix socket of the host. The protections line says
//! which identity the code runs as.

use std::io::ErrorKind;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::UnixListener;

use troupe_envs::sandbox::{Job, RunOutput, Sandbox, SandboxConfig, Termination};

fn sandbox() -> Sandbox {
    Sandbox::shared(&SandboxConfig { timeout_ms: 4_000, memory_mb: 256, ..SandboxConfig::default() })
        .expect("python3 must be installed to run the sandbox tests")
}

fn run(script: String) -> RunOutput {
    let output = sandbox().run(&Job::script(script)).expect("the sandbox starts");
    eprintln!("{:?}: {}", output.termination, output.output);
    output
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// A directory anyone may enter, holding a root-owned (when run as root) file and a socket.
fn open_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).expect("chmod");
    dir
}

#[test]
fn no_privileged_identity_reaches_the_code() {
    let protections = sandbox().protections().clone();
    eprintln!("{protections}");
    let line = protections.to_string();
    assert!(line.contains("runs as uid "), "{line}");
    let script = "import os\nprint('ids', os.getuid(), os.geteuid(), os.getgid(), os.getegid(), sorted(os.getgroups()))\n\
                  try:\n    os.setuid(0)\n    print('BECAME ROOT')\nexcept OSError as e:\n    print('refused', type(e).__name__)\n";
    let output = run(script.to_string());
    assert_eq!(output.termination, Termination::Exited(0));
    assert!(!output.output.contains("BECAME ROOT"), "{}", output.output);
    if is_root() {
        // Root's code runs as nobody, and the line says so.
        assert_eq!(protections.uid, Some(65534), "{line}");
        assert!(line.contains("uid 65534 gid 65534 (nobody)"), "{line}");
        assert!(output.output.contains("ids 65534 65534 65534 65534 []"), "{}", output.output);
    } else {
        // SAFETY: getuid has no preconditions.
        let uid = unsafe { libc::getuid() };
        assert!(line.contains(&format!("uid {uid}")), "{line}");
    }
}

#[test]
fn file_metadata_cannot_be_changed_inside_or_outside() {
    let outside = open_dir();
    let target = outside.path().join("root-owned");
    std::fs::write(&target, "x").expect("write");
    std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    let before = std::fs::metadata(&target).expect("stat");
    let script = format!(
        "import os\nopen('mine', 'w').write('x')\nfor path in ['mine', {target:?}]:\n    \
         for name, action in [\n        ('chmod', lambda: os.chmod(path, 0o4777)),\n        \
         ('chown', lambda: os.chown(path, 65534, 65534)),\n        ('utime', lambda: os.utime(path, (0, 0))),\n        \
         ('setxattr', lambda: os.setxattr(path, 'user.evil', b'1')),\n        ('removexattr', lambda: os.removexattr(path, 'user.x')),\n        \
         ('fchmod', lambda: os.fchmod(os.open(path, os.O_RDONLY), 0o777)),\n    ]:\n        \
         try:\n            action()\n            print('CHANGED', name, path)\n        except OSError as e:\n            \
         print('refused', name, type(e).__name__)\n",
        target = target.display().to_string()
    );
    let output = run(script);
    assert_eq!(output.termination, Termination::Exited(0));
    assert!(!output.output.contains("CHANGED"), "{}", output.output);
    assert_eq!(output.output.matches("refused").count(), 12, "{}", output.output);
    let after = std::fs::metadata(&target).expect("stat");
    assert_eq!(after.mode(), before.mode());
    assert_eq!((after.uid(), after.gid()), (before.uid(), before.gid()));
    assert_eq!(after.mtime(), before.mtime());
}

#[test]
fn unix_sockets_of_the_host_cannot_be_reached() {
    let dir = open_dir();
    let path = dir.path().join("host.sock");
    let listener = UnixListener::bind(&path).expect("bind a unix socket");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    listener.set_nonblocking(true).expect("nonblocking");
    let script = format!(
        "import socket\nfor kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):\n    try:\n        \
         s = socket.socket(socket.AF_UNIX, kind)\n        s.connect({path:?})\n        s.send(b'leak')\n        \
         print('CONNECTED')\n    except OSError as e:\n        print('refused', type(e).__name__)\n",
        path = path.display().to_string()
    );
    let output = run(script);
    assert_eq!(output.termination, Termination::Exited(0));
    assert!(!output.output.contains("CONNECTED"), "{}", output.output);
    assert_eq!(output.output.matches("refused").count(), 2, "{}", output.output);
    match listener.accept() {
        Err(err) => assert_eq!(err.kind(), ErrorKind::WouldBlock),
        Ok(_) => panic!("the sandboxed code connected to a unix socket of the host"),
    }
}

#[test]
fn root_only_files_stay_out_of_reach_of_the_code() {
    if !is_root() {
        eprintln!("NOTE: not root; the root-owned secret is only checked as root");
        return;
    }
    // A root-only directory (0700) beside a world-readable secret inside it.
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).expect("chmod");
    let secret = dir.path().join("secret");
    std::fs::write(&secret, "hunter2-root").expect("write");
    let script = format!(
        "try:\n    print('READ', open({secret:?}).read())\nexcept OSError as e:\n    print('refused', type(e).__name__)\n\
         import os\ntry:\n    print('LISTED', os.listdir('/root'))\nexcept OSError as e:\n    print('refused', type(e).__name__)\n",
        secret = secret.display().to_string()
    );
    let output = run(script);
    assert_eq!(output.termination, Termination::Exited(0));
    assert!(!output.output.contains("hunter2"), "{}", output.output);
    assert!(!output.output.contains("READ"), "{}", output.output);
    assert!(!output.output.contains(".bashrc"), "{}", output.output);
}

#[test]
fn root_refuses_to_hand_its_identity_to_the_code_unless_told_to() {
    if !is_root() {
        eprintln!("NOTE: not root; the refusal to run code as root is only checked as root");
        return;
    }
    let Ok(system) = std::fs::canonicalize("/usr/bin/python3") else {
        eprintln!("NOTE: no /usr/bin/python3 to copy");
        return;
    };
    // An interpreter only root may execute: nobody cannot run it, whatever is mounted.
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let private = dir.path().join("python3");
    // Copied by `cp`, not in this process: a file this process held open for writing could be
    // inherited by a child another test forks meanwhile, and executing it would then fail with
    // "text file busy".
    let copied = std::process::Command::new("cp").arg(&system).arg(&private).status().expect("cp runs");
    assert!(copied.success(), "copy the interpreter");
    std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    let config = SandboxConfig {
        python: private.display().to_string(),
        timeout_ms: 4_000,
        memory_mb: 256,
        ..SandboxConfig::default()
    };
    let err = Sandbox::new(config.clone()).expect_err("root's identity is not handed over silently").to_string();
    assert!(err.contains("run_as_root") && err.contains("nobody"), "{err}");
    let allowed = Sandbox::new(SandboxConfig { run_as_root: true, ..config }).expect("explicitly allowed");
    let line = allowed.protections().to_string();
    assert!(line.contains("runs as ROOT") && line.contains("run_as_root"), "{line}");
    let output = allowed.run(&Job::script("print('ok')")).expect("runs");
    assert_eq!(output.output.trim(), "ok");
}
