//! The inference-only baselines of the coding task, the protocols that papers on LLM
//! collaboration compare trained agent pairs against (`troupe eval` runs them next to the
//! trained pair):
//!
//! - [`CodingProtocol::Single`]: the main seat's agent writes the whole program alone (helper
//!   and main function in one reply);
//! - [`CodingProtocol::Parallel`]: both agents write at once without seeing each other (the
//!   coding environment's own one-turn episode);
//! - [`CodingProtocol::Sequential`]: the helper agent writes first; the main agent then sees
//!   the helper's code and writes the main function;
//! - [`CodingProtocol::Discussion`]: both write a first draft at once, each then sees the
//!   other's draft and writes a final version (one round), scored on the finals.
//!
//! Every protocol is one shot: the environment is built with `num_turns: 1` whatever the config
//! says, so the feedback turns of training play no part. All replies of one round, over all
//! episodes, are written by one [`ReplyWriter::write`] call: the seam where a model (troupe's
//! `AdapterWriter`: ONE batched generation whose rows use their agents' adapters), a person or
//! a test answers. Rewards are the
//! environment's level-based reward, invalid-reply penalties excluded (they are a training
//! signal, not a score); the invalid rate is reported beside them.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::evaluate::{self, Evaluation, Submission, Verdict};
use super::problems::Problem;
use super::reward::{self, LevelScores};
use super::{CodingEnv, HELPER_SEAT, MAIN_SEAT};
use crate::{Action, EnvError, Environment, Registry, SeatId};

/// What a [`ReplyWriter`] may fail with: any error, boxed (the writer is usually a model).
pub type WriterError = Box<dyn std::error::Error + Send + Sync>;

/// Why a protocol could not run.
#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    /// The setup cannot be run (no episode, a seat without an agent, not the coding task).
    #[error("inference-only protocols: {0}")]
    Setup(String),
    /// The environment could not be built or refused a step.
    #[error(transparent)]
    Env(#[from] EnvError),
    /// The coding task refused the final code's step.
    #[error("the coding task refused a step: {0}")]
    Step(crate::ActionError),
    /// The writer failed, or answered a different number of requests.
    #[error("writing replies: {0}")]
    Writer(WriterError),
}

type Result<T, E = ProtocolError> = std::result::Result<T, E>;

/// The inference-only baselines of the coding task.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CodingProtocol {
    /// One agent (the main seat's adapter) writes helper and main function in one reply.
    Single,
    /// Both agents write at once, neither seeing the other.
    Parallel,
    /// The helper agent writes first; the main agent writes seeing the helper's code.
    Sequential,
    /// Parallel first drafts, then each agent sees the other's draft and writes a final version.
    Discussion,
}

impl CodingProtocol {
    /// Every protocol, in the order papers list them.
    pub const ALL: [CodingProtocol; 4] =
        [CodingProtocol::Single, CodingProtocol::Parallel, CodingProtocol::Sequential, CodingProtocol::Discussion];

    /// The protocol's name as configs and the JSON summary write it.
    pub fn name(self) -> &'static str {
        match self {
            CodingProtocol::Single => "single",
            CodingProtocol::Parallel => "parallel",
            CodingProtocol::Sequential => "sequential",
            CodingProtocol::Discussion => "discussion",
        }
    }

    /// Replies written per episode.
    pub fn replies_per_episode(self) -> usize {
        match self {
            CodingProtocol::Single => 1,
            CodingProtocol::Parallel | CodingProtocol::Sequential => 2,
            CodingProtocol::Discussion => 4,
        }
    }

    /// Whether the cooperation level can be earned: not by a lone agent, whose program has no
    /// helper agent's function to call.
    pub fn cooperation_possible(self) -> bool {
        self != CodingProtocol::Single
    }
}

impl std::fmt::Display for CodingProtocol {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for CodingProtocol {
    type Err = ProtocolError;

    fn from_str(text: &str) -> Result<Self> {
        CodingProtocol::ALL.into_iter().find(|p| p.name() == text).ok_or_else(|| {
            ProtocolError::Setup(format!("{text:?} is not one of single, parallel, sequential, discussion"))
        })
    }
}

/// One reply to be written: by which agent, in which seat's role, and the prompt's two messages.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ReplyRequest {
    /// The problem's `task_id`.
    pub task_id: String,
    /// The role: [`HELPER_SEAT`] or [`MAIN_SEAT`] (a lone agent writes in the main seat).
    pub seat: SeatId,
    /// The agent whose adapter writes.
    pub agent: usize,
    /// The system message (the task's instructions).
    pub system: String,
    /// The user message (the problem, and the other agent's code where the protocol shows it).
    pub user: String,
}

/// Writes the replies of one round of a protocol, all episodes' at once.
pub trait ReplyWriter {
    /// One reply text per request, in order.
    fn write(&mut self, requests: &[ReplyRequest]) -> std::result::Result<Vec<String>, WriterError>;
}

impl<F: FnMut(&[ReplyRequest]) -> std::result::Result<Vec<String>, WriterError>> ReplyWriter for F {
    fn write(&mut self, requests: &[ReplyRequest]) -> std::result::Result<Vec<String>, WriterError> {
        self(requests)
    }
}

/// What a protocol runs on: the coding environment's spec as configs write it
/// (`{name: coding, ...}`), the registry that builds it, one seed per episode, and the agent of
/// each seat (`seat_agents[0]` the helper's, `seat_agents[1]` the main agent's).
#[derive(Clone, Copy)]
pub struct ProtocolSetup<'a> {
    /// The environment spec (`num_turns` is overridden to 1).
    pub env_spec: &'a Value,
    /// Builds the environment.
    pub registry: &'a Registry,
    /// One episode per seed.
    pub seeds: &'a [u64],
    /// Seat -> agent.
    pub seat_agents: &'a [usize],
}

/// One reply of a protocol's episode.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ProtocolReply {
    /// 0 for the first round, 1 for the second (sequential's main agent, discussion's finals).
    pub round: usize,
    /// What was asked.
    pub request: ReplyRequest,
    /// What the agent wrote.
    pub text: String,
    /// The code the environment's parser read from it; None when the reply held none (invalid).
    pub code: Option<String>,
}

/// One finished episode of a protocol.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ProtocolEpisode {
    /// The seed the environment was reset with.
    pub seed: u64,
    /// The problem.
    pub task_id: String,
    /// Every reply, round by round, helper before main within a round.
    pub replies: Vec<ProtocolReply>,
    /// The scored helper code (empty for [`CodingProtocol::Single`]).
    pub helper_code: String,
    /// The scored main code (for [`CodingProtocol::Single`], the lone agent's whole program).
    pub main_code: String,
    /// The reward by level.
    pub scores: LevelScores,
    /// The sandboxed evaluation (None when the structure level failed and nothing ran, or the
    /// sandbox itself failed).
    pub evaluation: Option<Evaluation>,
}

impl ProtocolEpisode {
    /// Whether every test passed.
    pub fn passed(&self) -> bool {
        self.evaluation.as_ref().is_some_and(|e| e.verdict == Verdict::Passed)
    }

    /// Whether the structure level held but no evaluation came back: the sandbox failed.
    fn sandbox_failed(&self) -> bool {
        self.scores.structure > 0.0 && self.evaluation.is_none()
    }
}

/// Mean reward of each level over the episodes.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct LevelMeans {
    /// Level 1: the functions are there with the right names.
    pub structure: f64,
    /// Level 2: the program parses.
    pub syntax: f64,
    /// Level 3: the fraction of asserts passed, weighted.
    pub tests: f64,
    /// Level 4: main calls the helper agent's function (always 0 for a lone agent).
    pub cooperation: f64,
    /// The mean highest level reached (0 to 4).
    pub level: f64,
}

/// A protocol's results over its episodes (the JSON `troupe eval` prints under `"protocols"`).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ProtocolSummary {
    /// The protocol.
    pub protocol: CodingProtocol,
    /// Episodes run (one problem each).
    pub episodes: usize,
    /// Mean episode reward (the environment's level-based reward, penalties excluded).
    pub mean_reward: f64,
    /// Standard error of `mean_reward` (sample standard deviation / sqrt(episodes); 0 for one).
    pub stderr_reward: f64,
    /// The most an episode can score under this protocol: the sum of the level weights, less
    /// the cooperation weight where cooperation is impossible.
    pub max_reward: f64,
    /// Episodes whose program passed every test.
    pub passed: usize,
    /// `passed / episodes`.
    pub pass_rate: f64,
    /// Mean fraction of asserts passed.
    pub mean_pass_fraction: f64,
    /// Mean reward of each level.
    pub levels: LevelMeans,
    /// Whether the cooperation level can be earned (false for `single`: it is reported as 0).
    pub cooperation_possible: bool,
    /// Replies written in all (`episodes x` the protocol's replies per episode).
    pub replies: usize,
    /// Replies that held no code.
    pub invalid_replies: usize,
    /// `invalid_replies / replies`.
    pub invalid_rate: f64,
    /// Episodes whose evaluation the sandbox failed to run (scored as not run).
    pub sandbox_errors: usize,
}

impl ProtocolSummary {
    /// Summarises `episodes` of `protocol`; `max_reward` as in [`ProtocolSummary::max_reward`].
    pub fn from_episodes(protocol: CodingProtocol, episodes: &[ProtocolEpisode], max_reward: f64) -> Self {
        let n = episodes.len();
        let mean = |f: &dyn Fn(&ProtocolEpisode) -> f64| {
            if n == 0 {
                0.0
            } else {
                episodes.iter().map(f).sum::<f64>() / n as f64
            }
        };
        let mean_reward = mean(&|e| e.scores.total);
        let stderr_reward = if n < 2 {
            0.0
        } else {
            let var = episodes.iter().map(|e| (e.scores.total - mean_reward).powi(2)).sum::<f64>() / (n - 1) as f64;
            (var / n as f64).sqrt()
        };
        let passed = episodes.iter().filter(|e| e.passed()).count();
        let replies = episodes.iter().map(|e| e.replies.len()).sum::<usize>();
        let invalid_replies = episodes.iter().flat_map(|e| &e.replies).filter(|r| r.code.is_none()).count();
        Self {
            protocol,
            episodes: n,
            mean_reward,
            stderr_reward,
            max_reward,
            passed,
            pass_rate: if n == 0 { 0.0 } else { passed as f64 / n as f64 },
            mean_pass_fraction: mean(&|e| e.evaluation.as_ref().map_or(0.0, Evaluation::pass_fraction)),
            levels: LevelMeans {
                structure: mean(&|e| e.scores.structure),
                syntax: mean(&|e| e.scores.syntax),
                tests: mean(&|e| e.scores.tests),
                cooperation: mean(&|e| e.scores.cooperation),
                level: mean(&|e| f64::from(e.scores.level)),
            },
            cooperation_possible: protocol.cooperation_possible(),
            replies,
            invalid_replies,
            invalid_rate: if replies == 0 { 0.0 } else { invalid_replies as f64 / replies as f64 },
            sandbox_errors: episodes.iter().filter(|e| e.sandbox_failed()).count(),
        }
    }
}

/// A protocol's summary with the episodes behind it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ProtocolRun {
    /// The summary.
    pub summary: ProtocolSummary,
    /// Every episode, in seed order.
    pub episodes: Vec<ProtocolEpisode>,
}

/// Whether `env` is the coding environment (the one task these protocols apply to).
pub fn is_coding_task(env: &dyn Environment) -> bool {
    env.as_any().is::<CodingEnv>()
}

/// Runs `protocol` on one coding episode per seed, every round's replies from one `writer`
/// call, and scores the final code in the sandbox.
pub fn run_protocol_with(
    writer: &mut dyn ReplyWriter,
    setup: &ProtocolSetup<'_>,
    protocol: CodingProtocol,
) -> Result<ProtocolRun> {
    let mut envs = build_envs(setup)?;
    let agent = |seat: SeatId| setup.seat_agents[seat];
    let first_seats: &[SeatId] = match protocol {
        CodingProtocol::Single => &[MAIN_SEAT],
        CodingProtocol::Parallel | CodingProtocol::Discussion => &[HELPER_SEAT, MAIN_SEAT],
        CodingProtocol::Sequential => &[HELPER_SEAT],
    };
    let first: Vec<Vec<ReplyRequest>> = envs
        .iter()
        .map(|episode| {
            let env = episode.coding();
            first_seats
                .iter()
                .map(|&seat| {
                    let (system, user) = match protocol {
                        CodingProtocol::Single => solo_messages(env.problem(), &env.params().helper_name),
                        _ => (env.instructions(seat), env.observation(seat)),
                    };
                    ReplyRequest { task_id: env.problem().task_id.clone(), seat, agent: agent(seat), system, user }
                })
                .collect()
        })
        .collect();
    let mut replies = write_round(writer, &envs, first, 0)?;
    if matches!(protocol, CodingProtocol::Sequential | CodingProtocol::Discussion) {
        let second: Vec<Vec<ReplyRequest>> = envs
            .iter()
            .zip(&replies)
            .map(|(episode, drafts)| {
                let env = episode.coding();
                let helper = env.params().helper_name.as_str();
                let entry = env.problem().entry_point.as_str();
                let code =
                    |seat: SeatId| drafts.iter().find(|r| r.request.seat == seat).and_then(|r| r.code.as_deref());
                let seats: &[SeatId] =
                    if protocol == CodingProtocol::Sequential { &[MAIN_SEAT] } else { &[HELPER_SEAT, MAIN_SEAT] };
                seats
                    .iter()
                    .map(|&seat| {
                        let note = if protocol == CodingProtocol::Sequential {
                            sequential_note(code(HELPER_SEAT), helper, entry)
                        } else {
                            discussion_note(seat, code(seat), code(1 - seat), helper, entry)
                        };
                        ReplyRequest {
                            task_id: env.problem().task_id.clone(),
                            seat,
                            agent: agent(seat),
                            system: env.instructions(seat),
                            user: format!("{}\n\n{note}", env.observation(seat)),
                        }
                    })
                    .collect()
            })
            .collect();
        for (episode, more) in replies.iter_mut().zip(write_round(writer, &envs, second, 1)?) {
            episode.extend(more);
        }
    }
    let episodes = score_episodes(&mut envs, setup.seeds, replies, protocol)?;
    let weights = &envs[0].coding().params().weights;
    let mut max_reward = weights.structure + weights.syntax + weights.tests;
    if protocol.cooperation_possible() {
        max_reward += weights.cooperation;
    }
    Ok(ProtocolRun { summary: ProtocolSummary::from_episodes(protocol, &episodes, max_reward), episodes })
}

/// One episode's environment: the coding task behind the `Environment` trait (stepped through
/// it, read through [`CodingEnv`]'s own accessors).
struct Episode {
    env: Box<dyn Environment>,
}

impl Episode {
    fn coding(&self) -> &CodingEnv {
        self.env.as_any().downcast_ref::<CodingEnv>().expect("build_envs keeps coding environments only")
    }
}

/// One coding environment per seed, reset, built with `num_turns: 1`.
fn build_envs(setup: &ProtocolSetup<'_>) -> Result<Vec<Episode>> {
    if setup.seeds.is_empty() {
        return Err(ProtocolError::Setup("the protocols need at least one episode".into()));
    }
    if setup.seat_agents.len() < 2 {
        return Err(ProtocolError::Setup("the coding task has two seats, each needs an agent".into()));
    }
    // Built once as given first, to name the environment if it is not the coding task.
    let probe = setup.registry.make_from_spec(setup.env_spec)?;
    if !is_coding_task(probe.as_ref()) {
        return Err(ProtocolError::Setup(format!("they are defined for the coding task, not {}", probe.name())));
    }
    let mut spec = setup.env_spec.clone();
    if let Some(object) = spec.as_object_mut() {
        object.insert("num_turns".to_string(), Value::from(1));
    }
    setup
        .seeds
        .iter()
        .map(|&seed| {
            let mut env = setup.registry.make_from_spec(&spec)?;
            if !is_coding_task(env.as_ref()) {
                return Err(ProtocolError::Setup("the registry built something other than the coding task".into()));
            }
            env.reset(seed);
            Ok(Episode { env })
        })
        .collect()
}

/// Writes one round: all episodes' requests in one `writer` call, each reply parsed by the
/// environment. Returns the replies per episode.
fn write_round(
    writer: &mut dyn ReplyWriter,
    envs: &[Episode],
    requests: Vec<Vec<ReplyRequest>>,
    round: usize,
) -> Result<Vec<Vec<ProtocolReply>>> {
    let flat: Vec<ReplyRequest> = requests.iter().flatten().cloned().collect();
    let texts = writer.write(&flat).map_err(ProtocolError::Writer)?;
    if texts.len() != flat.len() {
        return Err(ProtocolError::Writer(format!("{} requests got {} replies", flat.len(), texts.len()).into()));
    }
    let mut texts = texts.into_iter();
    Ok(envs
        .iter()
        .zip(requests)
        .map(|(episode, requests)| {
            requests
                .into_iter()
                .zip(texts.by_ref())
                .map(|(request, text)| {
                    let code = match episode.env.parse_action(request.seat, &text) {
                        Ok(Action::Text(code)) => Some(code),
                        _ => None,
                    };
                    ProtocolReply { round, request, text, code }
                })
                .collect()
        })
        .collect())
}

/// Scores every episode's final code, the episodes in parallel (the shared sandbox bounds how
/// many programs run at once).
fn score_episodes(
    envs: &mut [Episode],
    seeds: &[u64],
    replies: Vec<Vec<ProtocolReply>>,
    protocol: CodingProtocol,
) -> Result<Vec<ProtocolEpisode>> {
    std::thread::scope(|scope| {
        let handles: Vec<_> = envs
            .iter_mut()
            .zip(seeds)
            .zip(replies)
            .map(|((env, &seed), replies)| scope.spawn(move || score_episode(env, seed, replies, protocol)))
            .collect();
        handles
            .into_iter()
            .map(|handle| handle.join().map_err(|_| ProtocolError::Setup("scoring an episode panicked".into()))?)
            .collect()
    })
}

/// Scores one episode: the last reply of each seat (a missing or invalid one counts as no code).
fn score_episode(
    episode: &mut Episode,
    seed: u64,
    replies: Vec<ProtocolReply>,
    protocol: CodingProtocol,
) -> Result<ProtocolEpisode> {
    let last_code = |seat: SeatId| {
        replies.iter().rev().find(|r| r.request.seat == seat).and_then(|r| r.code.clone()).unwrap_or_default()
    };
    let task_id = episode.coding().problem().task_id.clone();
    let (helper_code, main_code, scores, evaluation) = if protocol == CodingProtocol::Single {
        let program = last_code(MAIN_SEAT);
        let (scores, evaluation) = score_solo(episode.coding(), &program);
        (String::new(), program, scores, evaluation)
    } else {
        let (helper, main) = (last_code(HELPER_SEAT), last_code(MAIN_SEAT));
        episode.env.step(&[Action::Text(helper), Action::Text(main)]).map_err(ProtocolError::Step)?;
        let turn = episode.coding().turns().last().expect("a step records its turn").clone();
        (turn.helper_code, turn.main_code, turn.scores, turn.evaluation)
    };
    Ok(ProtocolEpisode { seed, task_id, replies, helper_code, main_code, scores, evaluation })
}

/// Scores a lone agent's whole program with the environment's levels, sandbox and weights:
/// structure means the program defines the problem's function (a helper is the agents' way of
/// splitting work, optional for one agent); no helper agent exists, so the program is analysed
/// without one and the cooperation level stays 0.
pub fn score_solo(env: &CodingEnv, program: &str) -> (LevelScores, Option<Evaluation>) {
    let problem = env.problem();
    let params = env.params();
    let structure = reward::defines_function(program, &problem.entry_point);
    let evaluation = if structure {
        let submission = Submission {
            problem,
            program: format!("{}\n", program.trim_end()),
            helper_program: None,
            with_preamble: true,
            helper: None,
            assert_timeout_s: params.assert_timeout_ms as f64 / 1000.0,
        };
        match evaluate::evaluate(env.sandbox(), &submission) {
            Ok(evaluation) => Some(evaluation),
            Err(err) => {
                tracing::error!(target: "troupe::protocols", "sandbox error on {}: {err}", problem.task_id);
                None
            }
        }
    } else {
        None
    };
    let scores = reward::score(&params.weights, structure, evaluation.as_ref(), params.cooperation_needs_passing_test);
    (scores, evaluation)
}

/// A code block for a prompt, or a plain statement that there was none.
fn code_block(code: Option<&str>) -> String {
    match code.map(str::trim).filter(|code| !code.is_empty()) {
        Some(code) => format!("```python\n{code}\n```"),
        None => "(no code)".to_string(),
    }
}

/// The lone agent's system and user messages.
pub fn solo_messages(problem: &Problem, helper: &str) -> (String, String) {
    let entry = &problem.entry_point;
    let system = format!(
        "You solve a Python problem on your own; your code is run against hidden tests. Write a helper function \
         named `{helper}` that does a useful part of the work, and the function `{entry}` with the signature given \
         in the problem, which calls `{helper}(...)`. Answer with a single ```python code block holding only the \
         imports you need, `def {helper}(...)` and `def {entry}(...)`."
    );
    let user = format!(
        "Problem {}:\n```python\n{}\n```\nWrite `{helper}` and `{entry}`.",
        problem.task_id,
        problem.prompt.trim_matches('\n')
    );
    (system, user)
}

/// What the main agent of the sequential protocol reads after the problem: the helper agent's
/// code (or that it wrote none).
pub fn sequential_note(helper_code: Option<&str>, helper: &str, entry: &str) -> String {
    format!(
        "The helper agent has already written its part:\n{}\nWrite `{entry}`, calling `{helper}` as defined above.",
        code_block(helper_code)
    )
}

/// What `seat` reads after the problem in the discussion's second round: its own first draft
/// and its partner's, then the request for a final version.
pub fn discussion_note(seat: SeatId, own: Option<&str>, other: Option<&str>, helper: &str, entry: &str) -> String {
    let (partner, role) = if seat == HELPER_SEAT {
        ("main agent", format!("the helper `{helper}`"))
    } else {
        ("helper agent", format!("`{entry}`"))
    };
    format!(
        "First drafts. Yours:\n{}\nThe {partner}'s:\n{}\nTake your partner's draft into account and write your final \
         version of {role}.",
        code_block(own),
        code_block(other)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::coding::problems::shipped_problems;

    const SEEDS: [u64; 2] = [3, 11];

    fn spec() -> Value {
        // num_turns 3 in the config: the protocols still play one shot.
        serde_json::json!({"name": "coding", "num_turns": 3})
    }

    /// Answers with the shipped problems' reference code: the helper agent its helper, the main
    /// agent the canonical main function, a lone agent both in one program.
    fn canonical(requests: &[ReplyRequest]) -> std::result::Result<Vec<String>, WriterError> {
        let problems = shipped_problems();
        Ok(requests
            .iter()
            .map(|r| {
                let problem = problems.iter().find(|p| p.task_id == r.task_id).unwrap();
                let helper = problem.helper_solution.clone().unwrap();
                let main = format!("{}{}", problem.prompt, problem.canonical_solution);
                let code = if r.user.contains("Write `aux` and") {
                    format!("{helper}\n\n{main}")
                } else if r.seat == HELPER_SEAT {
                    helper
                } else {
                    main
                };
                format!("Here you go:\n```python\n{code}\n```")
            })
            .collect())
    }

    #[test]
    fn protocol_names_round_trip() {
        for protocol in CodingProtocol::ALL {
            assert_eq!(protocol.name().parse::<CodingProtocol>().unwrap(), protocol);
            assert_eq!(serde_json::to_value(protocol).unwrap(), Value::from(protocol.name()));
        }
        assert!("chat".parse::<CodingProtocol>().is_err());
    }

    #[test]
    fn prompts_show_the_drafts_the_protocol_promises() {
        let note = sequential_note(Some("def aux(x):\n    return x + 1\n"), "aux", "f");
        assert!(note.contains("```python\ndef aux(x):\n    return x + 1\n```"), "{note}");
        assert!(sequential_note(None, "aux", "f").contains("(no code)"));
        let note = discussion_note(MAIN_SEAT, Some("def f(): return aux()"), Some("def aux(): return 2"), "aux", "f");
        let (own, other) = (note.find("def f(): return aux()").unwrap(), note.find("def aux(): return 2").unwrap());
        assert!(own < other, "own draft first, then the partner's: {note}");
        assert!(note.contains("helper agent's") && note.ends_with("final version of `f`."), "{note}");
        let note = discussion_note(HELPER_SEAT, None, Some("def f(): pass"), "aux", "f");
        assert!(note.contains("(no code)") && note.contains("main agent's") && note.contains("def f(): pass"));
        let problem = &shipped_problems()[0];
        let (system, user) = solo_messages(problem, "aux");
        assert!(system.contains("`aux`") && system.contains(&problem.entry_point));
        assert!(user.contains(problem.prompt.trim_matches('\n')));
    }

    #[test]
    fn reference_code_scores_every_level_in_pairs_and_all_but_cooperation_alone() {
        let registry = Registry::with_builtins();
        let setup = ProtocolSetup { env_spec: &spec(), registry: &registry, seeds: &SEEDS, seat_agents: &[0, 1] };
        for protocol in CodingProtocol::ALL {
            let run = run_protocol_with(&mut canonical, &setup, protocol).unwrap();
            let s = &run.summary;
            assert_eq!((s.episodes, s.passed, s.pass_rate, s.invalid_replies), (2, 2, 1.0, 0), "{protocol}: {s:?}");
            assert_eq!(s.replies, 2 * protocol.replies_per_episode());
            assert_eq!(s.sandbox_errors, 0);
            if protocol == CodingProtocol::Single {
                assert_eq!((s.mean_reward, s.max_reward, s.levels.cooperation), (0.75, 0.75, 0.0));
                assert!(run.episodes.iter().all(|e| e.helper_code.is_empty() && e.main_code.contains("def aux")));
            } else {
                assert_eq!((s.mean_reward, s.max_reward, s.levels.cooperation, s.levels.level), (1.0, 1.0, 0.25, 4.0));
            }
            assert_eq!(s.stderr_reward, 0.0);
        }
    }

    #[test]
    fn sequential_and_discussion_show_the_other_agents_code_in_round_two() {
        let registry = Registry::with_builtins();
        let setup = ProtocolSetup { env_spec: &spec(), registry: &registry, seeds: &SEEDS[..1], seat_agents: &[0, 1] };
        let run = run_protocol_with(&mut canonical, &setup, CodingProtocol::Sequential).unwrap();
        let replies = &run.episodes[0].replies;
        assert_eq!(
            replies.iter().map(|r| (r.round, r.request.seat)).collect::<Vec<_>>(),
            [(0, HELPER_SEAT), (1, MAIN_SEAT)]
        );
        let helper_code = replies[0].code.as_deref().unwrap();
        assert!(helper_code.starts_with("def aux"));
        assert!(replies[1].request.user.contains(helper_code), "{}", replies[1].request.user);
        assert!(!replies[0].request.user.contains(helper_code), "the helper writes first, seeing nothing");

        let run = run_protocol_with(&mut canonical, &setup, CodingProtocol::Discussion).unwrap();
        let replies = &run.episodes[0].replies;
        let rounds: Vec<_> = replies.iter().map(|r| (r.round, r.request.seat, r.request.agent)).collect();
        assert_eq!(rounds, [(0, HELPER_SEAT, 0), (0, MAIN_SEAT, 1), (1, HELPER_SEAT, 0), (1, MAIN_SEAT, 1)]);
        for seat in [HELPER_SEAT, MAIN_SEAT] {
            let other_draft = replies[1 - seat].code.as_deref().unwrap().trim();
            assert!(!replies[seat].request.user.contains(other_draft), "drafts are written blind");
            assert!(replies[2 + seat].request.user.contains(other_draft), "finals see the partner's draft");
        }
    }

    #[test]
    fn bad_setups_are_refused_with_a_message() {
        let registry = Registry::with_builtins();
        let hanabi = serde_json::json!({"name": "hanabi", "players": 2});
        let setup = ProtocolSetup { env_spec: &hanabi, registry: &registry, seeds: &SEEDS, seat_agents: &[0, 1] };
        let err = run_protocol_with(&mut canonical, &setup, CodingProtocol::Single).unwrap_err().to_string();
        assert!(err.contains("coding task") && err.contains("hanabi"), "{err}");
        let coding = spec();
        let setup = ProtocolSetup { env_spec: &coding, registry: &registry, seeds: &[], seat_agents: &[0, 1] };
        assert!(run_protocol_with(&mut canonical, &setup, CodingProtocol::Single).is_err());
        let setup = ProtocolSetup { env_spec: &coding, registry: &registry, seeds: &SEEDS, seat_agents: &[0] };
        assert!(run_protocol_with(&mut canonical, &setup, CodingProtocol::Single).is_err());
        let mut short = |_: &[ReplyRequest]| -> std::result::Result<Vec<String>, WriterError> { Ok(Vec::new()) };
        let setup = ProtocolSetup { env_spec: &coding, registry: &registry, seeds: &SEEDS, seat_agents: &[0, 1] };
        assert!(run_protocol_with(&mut short, &setup, CodingProtocol::Parallel).is_err());
    }
}
