//! The sandbox's cost: one evaluation against a bare `python3 -c pass` (the floor any
//! process-per-evaluation design pays), and the evaluation rate with all CPUs in use.
//!
//! `cargo bench -p troupe-envs --bench sandbox`

#![allow(missing_docs)] // criterion_main! generates an undocumented `main`

use std::process::{Command, Stdio};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use troupe_envs::coding::evaluate::{evaluate, evaluate_many, Submission};
use troupe_envs::coding::problems::shipped_problems;
use troupe_envs::sandbox::{Job, Sandbox, SandboxConfig};

fn bench(c: &mut Criterion) {
    let sandbox = Sandbox::new(SandboxConfig::default()).expect("python3 is needed for this benchmark");
    eprintln!("protections: {}", sandbox.protections());
    let python = sandbox.protections().python.clone();
    let problems = shipped_problems();
    let submission = |i: usize| Submission {
        problem: &problems[i % problems.len()],
        program: problems[i % problems.len()].canonical_program(),
        helper_program: None,
        with_preamble: false,
        helper: Some("aux"),
        assert_timeout_s: 3.0,
    };

    let mut group = c.benchmark_group("one evaluation");
    group.sample_size(30);
    group.bench_function("bare python3 -c pass", |b| {
        b.iter(|| {
            let status = Command::new(&python)
                .args(["-c", "pass"])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .expect("python3 runs");
            assert!(status.success());
        })
    });
    group.bench_function("bare python3 -I -S -B -c pass", |b| {
        b.iter(|| {
            let status = Command::new(&python)
                .args(["-I", "-S", "-B", "-c", "pass"])
                .stdin(Stdio::null())
                .status()
                .expect("runs");
            assert!(status.success());
        })
    });
    let pass = Job::script("pass");
    group.bench_function("sandboxed pass", |b| b.iter(|| sandbox.run(&pass).expect("runs")));
    group.bench_function("sandboxed canonical solution with tests", |b| {
        let one = submission(0);
        b.iter(|| evaluate(&sandbox, &one).expect("runs"))
    });
    group.finish();

    let batch: Vec<Submission<'_>> = (0..32).map(submission).collect();
    let mut group = c.benchmark_group("throughput");
    group.sample_size(10);
    group.throughput(Throughput::Elements(batch.len() as u64));
    group.bench_function(format!("32 evaluations, {} at once", sandbox.parallelism()), |b| {
        b.iter(|| {
            let results = evaluate_many(&sandbox, &batch);
            assert!(results.iter().all(|r| r.as_ref().is_ok_and(|e| e.asserts_passed == e.asserts_total)));
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
