//! The sandbox against hostile code: every attack is contained with the right outcome, fast,
//! and the test process (standing in for the trainer) is unharmed.

use std::io::ErrorKind;
use std::net::TcpListener;
use std::time::Duration;

use troupe_envs::sandbox::{Job, RunOutput, Sandbox, SandboxConfig, Termination};
use troupe_envs::SandboxError;

/// Tight limits so that a failed containment cannot hurt the machine either.
fn sandbox() -> Sandbox {
    Sandbox::shared(&SandboxConfig {
        timeout_ms: 2_000,
        cpu_seconds: 5,
        memory_mb: 256,
        file_size_mb: 8,
        max_processes: 16,
        output_limit_bytes: 16 * 1024,
        ..SandboxConfig::default()
    })
    .expect("python3 must be installed to run the sandbox tests")
}

fn run(script: &str) -> RunOutput {
    let output = sandbox().run(&Job { script: script.to_string(), ..Job::default() }).expect("the sandbox starts");
    eprintln!(
        "{:?} in {:?}: {}",
        output.termination,
        output.wall_time,
        output.output.chars().take(400).collect::<String>()
    );
    output
}

#[test]
fn a_plain_program_runs_and_its_output_comes_back() {
    let output = run("print(6 * 7)");
    assert_eq!(output.termination, Termination::Exited(0));
    assert_eq!(output.output.trim(), "42");
    assert!(!output.output_truncated);
}

#[test]
fn infinite_loop_is_killed_at_the_wall_clock_limit() {
    let output = run("while True:\n    pass\n");
    assert_eq!(output.termination, Termination::TimedOut);
    assert!(output.wall_time < Duration::from_millis(3_500), "took {:?}", output.wall_time);
}

#[test]
fn sleeping_forever_is_killed_too() {
    let output = run("import time\ntime.sleep(3600)\n");
    assert_eq!(output.termination, Termination::TimedOut);
    assert!(output.wall_time < Duration::from_millis(3_500));
}

#[test]
fn fork_bomb_gets_no_processes() {
    let output = run("import os\n# fork-bomb-1\nwhile True:\n    os.fork()\n");
    assert_eq!(output.termination, Termination::Exited(1));
    assert!(
        output.output.contains("BlockingIOError") || output.output.contains("Resource temporarily unavailable"),
        "{}",
        output.output
    );
    assert_eq!(live_processes_with("fork-bomb-1"), 0);
}

#[test]
fn fork_bomb_with_subprocesses_allowed_hits_the_process_limit_and_is_cleaned_up() {
    let config = SandboxConfig {
        timeout_ms: 2_000,
        cpu_seconds: 2,
        memory_mb: 256,
        max_processes: 16,
        allow_subprocesses: true,
        ..SandboxConfig::default()
    };
    let sandbox = match Sandbox::new(config.clone()) {
        Ok(sandbox) => sandbox,
        Err(SandboxError::BadConfig { field, message }) => {
            // As root with an interpreter only root can reach, no process limit could bind:
            // the sandbox must refuse, and a system interpreter must work instead.
            assert_eq!(field, "allow_subprocesses", "{message}");
            Sandbox::new(SandboxConfig { python: "/usr/bin/python3".to_string(), ..config })
                .expect("the system python3 is usable")
        }
        Err(err) => panic!("{err}"),
    };
    eprintln!("{}", sandbox.protections());
    let script = "import os, time\n# fork-bomb-2\nfor _ in range(10000):\n    try:\n        os.fork()\n    except OSError:\n        time.sleep(0.05)\n";
    let output = sandbox.run(&Job { script: script.to_string(), ..Job::default() }).expect("runs");
    eprintln!("{:?} {:?}", output.termination, output.wall_time);
    assert!(output.wall_time < Duration::from_millis(3_500));
    assert_eq!(live_processes_with("fork-bomb-2"), 0);
}

#[test]
fn allocating_ten_gigabytes_fails_with_memory_error() {
    let output = run("x = bytearray(10 * 1024 ** 3)\nprint('allocated')\n");
    assert_eq!(output.termination, Termination::Exited(1));
    assert!(output.output.contains("MemoryError"), "{}", output.output);
    assert!(!output.output.contains("allocated"));
}

#[test]
fn writing_a_one_gigabyte_file_stops_at_the_file_size_limit() {
    let script = "chunk = b'0' * (1 << 20)\nwith open('big', 'wb') as f:\n    for _ in range(1024):\n        f.write(chunk)\nprint('wrote 1 GB')\n";
    let output = run(script);
    assert_eq!(output.termination, Termination::Exited(1));
    assert!(output.output.contains("File too large"), "{}", output.output);
    assert!(!output.output.contains("wrote 1 GB"));
}

#[test]
fn writing_outside_its_directory_is_refused() {
    let sandbox = sandbox();
    if sandbox.protections().landlock_abi.is_none() {
        eprintln!("NOTE: Landlock is not available on this kernel; file-system confinement is inactive");
        return;
    }
    let target = std::env::temp_dir().join(format!("troupe-escape-{}", std::process::id()));
    let script = format!(
        "import os\nfor path in [{:?}, '../troupe-escape-sibling', os.path.expanduser('~/../escape')]:\n    try:\n        open(path, 'w').write('x')\n        print('WROTE', path)\n    except OSError as e:\n        print('refused', path, type(e).__name__)\n",
        target.display().to_string()
    );
    let output = run(&script);
    assert_eq!(output.termination, Termination::Exited(0));
    assert!(!output.output.contains("WROTE"), "{}", output.output);
    assert_eq!(output.output.matches("refused").count(), 3);
    assert!(!target.exists());
}

#[test]
fn network_connections_are_refused() {
    let sandbox = sandbox();
    assert!(sandbox.protections().network_blocked(), "no network protection active: {}", sandbox.protections());
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind a local listener");
    listener.set_nonblocking(true).expect("nonblocking");
    let port = listener.local_addr().expect("address").port();
    let script = format!(
        "import socket\ntry:\n    s = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n    s.sendall(b'leak')\n    print('CONNECTED')\nexcept OSError as e:\n    print('refused', type(e).__name__, e)\n"
    );
    let output = run(&script);
    assert_eq!(output.termination, Termination::Exited(0));
    assert!(output.output.contains("refused"), "{}", output.output);
    assert!(!output.output.contains("CONNECTED"));
    match listener.accept() {
        Err(err) => assert_eq!(err.kind(), ErrorKind::WouldBlock),
        Ok((_, peer)) => panic!("the sandboxed code reached the host network from {peer}"),
    }
}

#[test]
fn the_parents_environment_is_not_visible() {
    // SAFETY: set once, before any sandbox in this test reads the environment; std's Command
    // clears the child's environment anyway, which is what is under test.
    unsafe { std::env::set_var("TROUPE_TEST_SECRET", "hunter2-sandbox") };
    let sandbox = sandbox();
    // Reading /proc/<parent>/environ is stopped by Landlock (no /proc in the read list) or by
    // running as another user; without either, only the cleared environment is checked.
    let proc_blocked = sandbox.protections().landlock_abi.is_some() || sandbox.protections().uid.is_some();
    if !proc_blocked {
        eprintln!("NOTE: neither Landlock nor a user switch is available; /proc/<pid>/environ is not checked");
    }
    let script = format!(
        "import os\nprint('env', dict(os.environ))\nif {}:\n    for pid in [os.getppid(), {}]:\n        try:\n            print('proc', open(f'/proc/{{pid}}/environ', 'rb').read())\n        except OSError as e:\n            print('refused', type(e).__name__)\n",
        if proc_blocked { "True" } else { "False" },
        std::process::id()
    );
    let output = sandbox.run(&Job { script, ..Job::default() }).expect("runs");
    eprintln!("{}", output.output);
    assert_eq!(output.termination, Termination::Exited(0));
    assert!(!output.output.contains("hunter2"), "{}", output.output);
    assert!(output.output.contains("env {"));
    if proc_blocked {
        assert_eq!(output.output.matches("refused").count(), 2, "{}", output.output);
    }
}

#[test]
fn killing_the_parent_is_refused() {
    let sandbox = sandbox();
    let protections = sandbox.protections();
    let signals_blocked = protections.seccomp || protections.landlock_scoped || protections.uid.is_some();
    assert!(signals_blocked, "no layer stops signals to the trainer on this system: {protections}");
    let script = format!(
        "import os, signal\nfor pid in [os.getppid(), {}]:\n    try:\n        os.kill(pid, signal.SIGKILL)\n        print('KILLED', pid)\n    except OSError as e:\n        print('refused', type(e).__name__)\n",
        std::process::id()
    );
    let output = sandbox.run(&Job { script, ..Job::default() }).expect("runs");
    // Still here: the trainer survived.
    assert_eq!(output.termination, Termination::Exited(0));
    assert!(!output.output.contains("KILLED"), "{}", output.output);
    assert_eq!(output.output.matches("refused").count(), 2, "{}", output.output);
}

#[test]
fn printing_a_hundred_megabytes_is_capped() {
    let output = run("import sys\nsys.stdout.write('x' * 100_000_000)\nprint('done')\n");
    assert_eq!(output.termination, Termination::Exited(0));
    assert!(output.output_bytes >= 100_000_000);
    assert!(output.output.len() <= 16 * 1024);
    assert!(output.output_truncated);
}

#[test]
fn the_cpu_limit_ends_a_busy_process() {
    let sandbox =
        Sandbox::new(SandboxConfig { timeout_ms: 10_000, cpu_seconds: 1, ..SandboxConfig::default() }).expect("starts");
    let output = sandbox.run(&Job { script: "while True:\n    pass\n".to_string(), ..Job::default() }).expect("runs");
    assert_eq!(output.termination, Termination::Signaled(libc_sigxcpu()));
    assert!(output.wall_time < Duration::from_secs(4));
}

#[test]
fn many_jobs_run_in_parallel_in_order() {
    let jobs: Vec<Job> = (0..8).map(|i| Job { script: format!("print({i} * {i})"), ..Job::default() }).collect();
    let outputs = sandbox().run_many(&jobs);
    for (i, output) in outputs.into_iter().enumerate() {
        let output = output.expect("runs");
        assert_eq!(output.output.trim(), (i * i).to_string());
    }
}

#[test]
fn job_files_are_in_the_working_directory() {
    let job = Job {
        script: "print(open('data.txt').read())".to_string(),
        files: vec![("data.txt".to_string(), b"hello".to_vec())],
        stdin: Vec::new(),
    };
    let output = sandbox().run(&job).expect("runs");
    assert_eq!(output.output.trim(), "hello");
}

fn libc_sigxcpu() -> i32 {
    24
}

/// Processes still alive (not zombies) whose command line holds `marker`, after a short grace
/// for the kernel to finish delivering SIGKILL.
fn live_processes_with(marker: &str) -> usize {
    std::thread::sleep(Duration::from_millis(200));
    let Ok(entries) = std::fs::read_dir("/proc") else { return 0 };
    entries
        .filter_map(Result::ok)
        .filter(|entry| {
            let dir = entry.path();
            let cmdline = std::fs::read(dir.join("cmdline")).unwrap_or_default();
            let stat = std::fs::read_to_string(dir.join("stat")).unwrap_or_default();
            let zombie = stat.rsplit(')').next().is_some_and(|rest| rest.trim_start().starts_with('Z'));
            !zombie && String::from_utf8_lossy(&cmdline).contains(marker)
        })
        .count()
}

/// Each layer holds on its own, for systems that lack the others (no user namespaces on some
/// CI runners, no Landlock on older kernels).
#[test]
fn each_layer_alone_still_refuses_network_and_signals() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind a local listener");
    listener.set_nonblocking(true).expect("nonblocking");
    let port = listener.local_addr().expect("address").port();
    let network = format!(
        "import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n    print('CONNECTED')\nexcept OSError as e:\n    print('refused', e)\n"
    );
    let kill = format!(
        "import os, signal\ntry:\n    os.kill({}, signal.SIGKILL)\n    print('KILLED')\nexcept OSError as e:\n    print('refused', e)\n",
        std::process::id()
    );
    let base = SandboxConfig { timeout_ms: 3_000, memory_mb: 256, ..SandboxConfig::default() };
    let layers = [
        ("seccomp only", SandboxConfig { network_namespace: false, landlock: false, ..base.clone() }),
        ("landlock only", SandboxConfig { network_namespace: false, seccomp: false, ..base.clone() }),
        ("namespace only", SandboxConfig { landlock: false, seccomp: false, ..base.clone() }),
    ];
    for (name, config) in layers {
        let sandbox = Sandbox::new(config).expect("starts");
        let protections = sandbox.protections().clone();
        eprintln!("{name}: {protections}");
        let signals_blocked = protections.seccomp || protections.landlock_scoped || protections.uid.is_some();
        if !protections.network_blocked() {
            eprintln!("NOTE: {name}: this layer is not available here");
            continue;
        }
        // Only attack the test process where a layer claims to stop it (a user namespace alone
        // does not: the code keeps the trainer's user id).
        let script = if signals_blocked { format!("{network}{kill}") } else { network.clone() };
        let output = sandbox.run(&Job { script, ..Job::default() }).expect("runs");
        eprintln!("{name}: {}", output.output);
        assert_eq!(output.termination, Termination::Exited(0), "{name}");
        assert!(protections.network_blocked(), "{name}: no network layer active");
        assert!(!output.output.contains("CONNECTED"), "{name}: {}", output.output);
        assert!(!output.output.contains("KILLED"), "{name}: {}", output.output);
    }
    assert!(listener.accept().is_err());
}

#[test]
fn the_default_sandbox_reports_its_protections() {
    let protections = sandbox().protections().clone();
    eprintln!("{protections}");
    assert!(protections.network_blocked());
    assert!(protections.python.is_absolute());
    assert!(protections.python_version.starts_with("3."));
}

#[test]
fn filling_the_disk_file_by_file_is_stopped() {
    // Each file stays under the file-size limit; together they pass the disk allowance.
    let script = "chunk = b'0' * (1 << 20)\nfor i in range(10_000):\n    with open(f'f{i}', 'wb') as f:\n        for _ in range(7):\n            f.write(chunk)\nprint('FILLED')\n";
    let output = run(script);
    assert_eq!(output.termination, Termination::DiskLimit);
    assert!(!output.output.contains("FILLED"));
}

#[test]
fn reading_outside_the_interpreter_and_system_libraries_is_refused() {
    let sandbox = sandbox();
    if sandbox.protections().landlock_abi.is_none() {
        eprintln!("NOTE: Landlock is not available on this kernel; reads are not confined");
        return;
    }
    let secret_dir = tempfile::tempdir().expect("temp dir");
    let secret = secret_dir.path().join("token");
    std::fs::write(&secret, "hunter2-file").expect("write");
    let script = format!(
        "for path in [{:?}, '/etc/hostname', '/proc/self/environ']:\n    try:\n        print('READ', open(path).read())\n    except OSError as e:\n        print('refused', type(e).__name__)\n",
        secret.display().to_string()
    );
    let output = sandbox.run(&Job { script, ..Job::default() }).expect("runs");
    assert_eq!(output.termination, Termination::Exited(0));
    assert!(!output.output.contains("READ"), "{}", output.output);
    assert_eq!(output.output.matches("refused").count(), 3, "{}", output.output);
}
