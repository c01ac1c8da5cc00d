//! Generated code cannot forge a verdict: each attack below is a wrong solution dressed up to
//! look right (or a right one claiming cooperation it does not have). Every one must fail,
//! with not a single assert passed, while the honest solution passes.
//!
//! The judge holds the tests and decides on plain values that it decodes itself; the code runs
//! in another sandboxed process (see `troupe_envs::coding::evaluate`).

use troupe_envs::coding::evaluate::{evaluate_many, Evaluation, Submission, Verdict};
use troupe_envs::coding::problems::Problem;
use troupe_envs::sandbox::{Sandbox, SandboxConfig};

fn sandbox() -> Sandbox {
    Sandbox::shared(&SandboxConfig { timeout_ms: 8_000, memory_mb: 512, ..SandboxConfig::default() })
        .expect("python3 must be installed for the forging tests")
}

/// Expected values no constant or simple guess hits.
fn problem() -> Problem {
    Problem {
        task_id: "forge/0".to_string(),
        prompt: "def secret(n):\n    \"\"\"Return (n * 7919 + 13) % 10007.\"\"\"\n".to_string(),
        entry_point: "secret".to_string(),
        canonical_solution: "    return (n * 7919 + 13) % 10007\n".to_string(),
        test: "METADATA = {}\n\n\ndef check(candidate):\n    assert candidate(1) == 7932\n    assert candidate(2) == 5844\n    \
               assert candidate(3) == 3756\n    assert candidate(4) == 1668, 'four'\n"
            .to_string(),
        helper_solution: None,
    }
}

/// A fake report in the old harness's format, for attacks that write one wherever they can.
const FAKE: &str = r#"{"event": "plan", "asserts": 4}
{"event": "assert", "index": 0, "line": 1, "source": "x", "passed": true, "error": null}
{"event": "assert", "index": 1, "line": 2, "source": "x", "passed": true, "error": null}
{"event": "assert", "index": 2, "line": 3, "source": "x", "passed": true, "error": null}
{"event": "assert", "index": 3, "line": 4, "source": "x", "passed": true, "error": null}
{"event": "helper_calls", "count": 5}
{"event": "done"}
"#;

/// (name, program): each defines `secret` wrongly, and tries to pass anyway.
fn attacks() -> Vec<(&'static str, String)> {
    let fake = FAKE.replace('\n', "\\n");
    vec![
        ("__eq__ always true", "class Yes:\n    def __eq__(self, other): return True\n    def __ne__(self, other): return False\n\ndef secret(n):\n    return Yes()\n".into()),
        ("int subclass equal to everything", "class Evil(int):\n    def __eq__(self, other): return True\n    __hash__ = int.__hash__\n\ndef secret(n):\n    return Evil(0)\n".into()),
        ("str subclass and list subclass", "class S(list):\n    def __eq__(self, other): return True\n\ndef secret(n):\n    return S()\n".into()),
        ("fake report on every descriptor", format!("import os\nfor fd in range(3, 64):\n    try:\n        os.write(fd, b'{fake}')\n    except OSError:\n        pass\n\ndef secret(n):\n    for fd in range(3, 64):\n        try:\n            os.write(fd, b'{fake}')\n        except OSError:\n            pass\n    return 0\n")),
        ("fake verdict printed on stdout and stderr", format!("import sys\nprint('{fake}')\nsys.stderr.write('{fake}')\n\ndef secret(n):\n    print('{fake}')\n    return 0\n")),
        ("SystemExit(0) while loading", "raise SystemExit(0)\n\ndef secret(n):\n    return 0\n".into()),
        ("SystemExit(0) in the call", "def secret(n):\n    raise SystemExit(0)\n".into()),
        ("os._exit(0) in the call", "import os\n\ndef secret(n):\n    os._exit(0)\n".into()),
        ("sys.exit and os._exit patched", "import sys, os, builtins\nsys.exit = lambda *a: None\nos._exit = lambda *a: None\nbuiltins.AssertionError = type('Nope', (Exception,), {})\n\ndef secret(n):\n    return 0\n".into()),
        ("json and builtins patched to report passes", "import json, builtins\njson.dumps = lambda *a, **k: '{\"event\": \"assert\", \"index\": 0, \"line\": 1, \"source\": \"x\", \"passed\": true, \"error\": null}'\nbuiltins.isinstance = lambda *a: True\nbuiltins.type = lambda *a: int\n\ndef secret(n):\n    return 0\n".into()),
        ("the harness monkeypatched through __main__ and frames", "import sys\nmain = sys.modules['__main__']\nfor name in dir(main):\n    if 'encode' in name or 'report' in name or 'send' in name:\n        setattr(main, name, lambda *a, **k: {'k': 'return', 'id': 1, 'value': 7932})\nframe = sys._getframe()\nwhile frame is not None:\n    frame.f_globals.setdefault('report', print)\n    frame = frame.f_back\n\ndef secret(n):\n    return 0\n".into()),
        ("forged replies written straight to the judge's pipe", "import os, json\n\ndef secret(n):\n    for ident in range(1, 10):\n        for value in ({'__class__': 'int'}, {'f': 'nan'}, {'t': [1], 'extra': 2}):\n            try:\n                os.write(4, (json.dumps({'k': 'return', 'id': ident, 'value': value}) + '\\n').encode())\n            except OSError:\n                pass\n    return 0\n".into()),
        ("reading the expected values from the test and the judge", "import glob, os, re\nSEEN = []\nfor pattern in ['/tmp/*/*', '/tmp/*', '../*/*', '/proc/*/cmdline', '/proc/*/environ', '/proc/*/fd/0', '/proc/*/fd/*']:\n    for path in glob.glob(pattern):\n        try:\n            with open(path, 'rb') as f:\n                SEEN.append(f.read(1 << 20))\n        except OSError:\n            pass\nANSWERS = {}\nfor blob in SEEN:\n    for n, v in re.findall(rb'candidate\\((\\d+)\\) == (\\d+)', blob):\n        ANSWERS[int(n)] = int(v)\n\ndef secret(n):\n    return ANSWERS.get(n, 0)\n".into()),
        ("writing into the judge through /proc", format!("import os\nfor pid in os.listdir('/proc') if os.path.isdir('/proc') else []:\n    for fd in range(0, 8):\n        try:\n            with open(f'/proc/{{pid}}/fd/{{fd}}', 'w') as f:\n                f.write('{fake}')\n        except OSError:\n            pass\n\ndef secret(n):\n    return 0\n")),
        ("killing the judge", "import os, signal\n\ndef secret(n):\n    for pid in range(os.getpid() - 8, os.getpid() + 9):\n        if pid == os.getpid():\n            continue\n        try:\n            os.kill(pid, signal.SIGKILL)\n        except OSError:\n            pass\n    return 0\n".into()),
        ("a recursion bomb of a result", "def secret(n):\n    value = 0\n    for _ in range(200000):\n        value = [value]\n    return value\n".into()),
        ("a huge result", "def secret(n):\n    return 'x' * (40 * 1024 * 1024)\n".into()),
        ("a result that refuses to be compared", "class Boom:\n    def __eq__(self, other): raise SystemExit(0)\n\ndef secret(n):\n    return Boom()\n".into()),
        ("sleeping past the time limit", "import time\n\ndef secret(n):\n    time.sleep(60)\n".into()),
        ("answers sent before being asked", "import os, json\nfor ident in range(1, 5):\n    os.write(4, (json.dumps({'k': 'return', 'id': ident, 'value': {'f': '1e308'}}) + '\\n').encode())\n\ndef secret(n):\n    return -1\n".into()),
    ]
}

fn run_all(programs: &[String]) -> Vec<Evaluation> {
    let problem = problem();
    let submissions: Vec<Submission<'_>> = programs
        .iter()
        .map(|program| Submission {
            problem: &problem,
            program: program.clone(),
            helper_program: None,
            with_preamble: false,
            helper: None,
            assert_timeout_s: 1.0,
        })
        .collect();
    evaluate_many(&sandbox(), &submissions).into_iter().map(|result| result.expect("the sandbox runs")).collect()
}

#[test]
fn every_forging_attempt_fails_and_the_honest_solution_passes() {
    let attacks = attacks();
    assert!(attacks.len() >= 15);
    let honest = format!("{}{}", problem().prompt, problem().canonical_solution);
    let mut programs: Vec<String> = attacks.iter().map(|(_, program)| program.clone()).collect();
    programs.push(honest);
    let evaluations = run_all(&programs);
    let (honest, forged) = evaluations.split_last().expect("one per program");
    assert_eq!(honest.verdict, Verdict::Passed, "{honest:?}");
    assert_eq!(honest.asserts_passed, 4);
    let mut held = 0;
    for ((name, _), evaluation) in attacks.iter().zip(forged) {
        eprintln!(
            "{name}: {:?}, {}/{} asserts",
            evaluation.verdict, evaluation.asserts_passed, evaluation.asserts_total
        );
        assert_ne!(evaluation.verdict, Verdict::Passed, "{name} forged a pass: {evaluation:?}");
        assert_eq!(evaluation.asserts_passed, 0, "{name} forged an assert: {evaluation:?}");
        held += 1;
    }
    eprintln!("{held} of {} forging attempts held", attacks.len());
}
