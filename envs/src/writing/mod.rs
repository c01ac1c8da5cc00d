//! The two-agent writing tasks. `writing`: two agents expand an article abstract together,
//! agent 0 (background) writing the motivation and context, agent 1 (complementary) the
//! method and contributions. `writing_tldr`: agent 0 writes a short summary of a post, agent 1
//! a longer, more detailed one. Both act at once and share one level-based reward
//! ([`reward::WritingReward`]); with `num_turns` > 1 each then sees both texts and revises.
//!
//! Datasets are JSONL with the source text under a configurable field (`abstract` for
//! `writing`, `post` for `writing_tldr`); small samples written for troupe are shipped.

pub mod reward;
pub mod words;

use std::path::PathBuf;
use std::sync::Arc;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::environment::{Action, ActionError, Environment, EpisodeMetrics, LegalAction, SeatId};
use crate::error::EnvError;
use crate::registry::{parse_params, Registry};
use reward::{WritingReward, WritingScores};

/// The shipped sample of article abstracts (field `abstract`).
pub const SHIPPED_ABSTRACTS: &str = include_str!("../../data/writing_abstracts.jsonl");
/// The shipped sample of posts to summarise (field `post`).
pub const SHIPPED_POSTS: &str = include_str!("../../data/writing_posts.jsonl");

/// Which writing task.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WritingTask {
    /// Abstract expansion (background + complementary).
    Arxiv,
    /// Summaries (short + detailed).
    Tldr,
}

impl WritingTask {
    /// The registry name.
    pub fn env_name(self) -> &'static str {
        match self {
            WritingTask::Arxiv => "writing",
            WritingTask::Tldr => "writing_tldr",
        }
    }
}

/// Parameters (`env: {name: writing, ...}`); defaults depend on the task.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WritingParams {
    /// A JSONL file of source texts; none: the shipped sample.
    pub dataset: Option<PathBuf>,
    /// The field of each line holding the source text.
    pub field: String,
    /// Turns per episode.
    pub num_turns: usize,
    /// The reward's bands, weights and word lists.
    pub reward: WritingReward,
    /// The part of the dataset episodes draw from (`all`, `train`, or the held-out `test`).
    #[serde(default)]
    pub split: crate::split::Split,
}

impl WritingParams {
    /// The defaults of `task`.
    pub fn defaults(task: WritingTask) -> Self {
        match task {
            WritingTask::Arxiv => Self {
                dataset: None,
                field: "abstract".to_string(),
                num_turns: 1,
                reward: WritingReward::arxiv(),
                split: Default::default(),
            },
            WritingTask::Tldr => Self {
                dataset: None,
                field: "post".to_string(),
                num_turns: 1,
                reward: WritingReward::tldr(),
                split: Default::default(),
            },
        }
    }

    /// Reads parameters given as a (partial) JSON object over the defaults of `task`: every
    /// field, nested ones included, may be left out; unknown fields are errors.
    pub fn from_value(task: WritingTask, params: &Value) -> Result<Self, EnvError> {
        let mut merged = serde_json::to_value(Self::defaults(task)).expect("the defaults serialize");
        if !params.is_null() {
            merge(&mut merged, params);
        }
        parse_params(task.env_name(), &merged)
    }
}

/// Deep-merges `patch` into `base` (objects key by key, anything else replaced).
fn merge(base: &mut Value, patch: &Value) {
    match (base, patch) {
        (Value::Object(base), Value::Object(patch)) => {
            for (key, value) in patch {
                match base.get_mut(key) {
                    // A word-list map is replaced whole, not merged category by category.
                    Some(slot) if key != "transition_words" => merge(slot, value),
                    _ => {
                        base.insert(key.clone(), value.clone());
                    }
                }
            }
        }
        (base, patch) => *base = patch.clone(),
    }
}

/// One turn's texts and reward.
#[derive(Clone, Debug, Serialize)]
pub struct WritingTurn {
    /// Agent 0's text.
    pub first: String,
    /// Agent 1's text.
    pub second: String,
    /// The reward by level.
    pub scores: WritingScores,
}

/// The writing environment.
pub struct WritingEnv {
    task: WritingTask,
    params: WritingParams,
    sources: Arc<Vec<String>>,
    source: usize,
    turns: Vec<WritingTurn>,
    returns: [f64; 2],
}

fn read_sources(text: &str, field: &str, origin: &str) -> Result<Vec<String>, EnvError> {
    let mut sources = Vec::new();
    for (number, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let bad = |message: String| EnvError::Data {
            path: origin.to_string(),
            message: format!("line {}: {message}", number + 1),
        };
        let value: Value = serde_json::from_str(line).map_err(|err| bad(err.to_string()))?;
        let source =
            value.get(field).and_then(Value::as_str).ok_or_else(|| bad(format!("no string field {field:?}")))?;
        sources.push(source.to_string());
    }
    if sources.is_empty() {
        return Err(EnvError::Data { path: origin.to_string(), message: "no texts in the dataset".to_string() });
    }
    Ok(sources)
}

impl WritingEnv {
    /// Builds the environment, reading its dataset.
    pub fn new(task: WritingTask, params: WritingParams) -> Result<Self, EnvError> {
        let bad = |field: &str, message: String| EnvError::BadParam {
            env: task.env_name().to_string(),
            field: field.to_string(),
            message,
        };
        if params.num_turns == 0 {
            return Err(bad("num_turns", "must be at least 1".to_string()));
        }
        params.reward.validate().map_err(|message| bad("reward", message))?;
        let sources = match &params.dataset {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|err| EnvError::Data { path: path.display().to_string(), message: err.to_string() })?;
                read_sources(&text, &params.field, &path.display().to_string())?
            }
            None => {
                let (text, origin) = match task {
                    WritingTask::Arxiv => (SHIPPED_ABSTRACTS, "envs/data/writing_abstracts.jsonl"),
                    WritingTask::Tldr => (SHIPPED_POSTS, "envs/data/writing_posts.jsonl"),
                };
                read_sources(text, &params.field, origin)?
            }
        };
        let sources = params.split.select(sources);
        if sources.is_empty() {
            return Err(bad("split", format!("the {:?} split of the dataset is empty", params.split)));
        }
        Ok(Self { task, params, sources: Arc::new(sources), source: 0, turns: Vec::new(), returns: [0.0; 2] })
    }

    /// Registers `writing` and `writing_tldr` in `registry`.
    pub fn register(registry: &mut Registry) {
        for (task, description) in [
            (
                WritingTask::Arxiv,
                "two agents expand an article abstract (background + method); level-based text reward",
            ),
            (WritingTask::Tldr, "two agents summarise a post (short + detailed); level-based text reward, TL;DR bands"),
        ] {
            registry.register(task.env_name(), description, move |params| {
                Ok(Box::new(WritingEnv::new(task, WritingParams::from_value(task, params)?)?) as Box<dyn Environment>)
            });
        }
    }

    /// The source text of this episode.
    pub fn source(&self) -> &str {
        &self.sources[self.source]
    }

    /// The parameters.
    pub fn params(&self) -> &WritingParams {
        &self.params
    }

    /// The turns played so far.
    pub fn turns(&self) -> &[WritingTurn] {
        &self.turns
    }

    fn role(&self, seat: SeatId) -> &'static str {
        match (self.task, seat) {
            (WritingTask::Arxiv, 0) => "the background agent: write the motivation and context of the work (why the problem matters, what came before)",
            (WritingTask::Arxiv, _) => "the complementary agent: write the method and the contributions (how the work is done, what it finds)",
            (WritingTask::Tldr, 0) => "the concise agent: write a short summary of the post",
            (WritingTask::Tldr, _) => "the detailed agent: write a longer, more detailed summary of the post, adding what the short one leaves out",
        }
    }
}

impl Environment for WritingEnv {
    fn name(&self) -> &str {
        self.task.env_name()
    }

    fn num_seats(&self) -> usize {
        2
    }

    fn reset(&mut self, seed: u64) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        self.source = rng.random_range(0..self.sources.len());
        self.turns.clear();
        self.returns = [0.0; 2];
    }

    fn acting_seats(&self) -> Vec<SeatId> {
        if self.is_terminal() {
            Vec::new()
        } else {
            vec![0, 1]
        }
    }

    fn instructions(&self, seat: SeatId) -> String {
        let reward = &self.params.reward;
        let what = match self.task {
            WritingTask::Arxiv => "Two agents expand an article abstract into a longer text together",
            WritingTask::Tldr => "Two agents summarise a post together",
        };
        format!(
            "{what}; the pair shares one reward. You are {}. Write {}-{} words of plain prose, with a vocabulary \
             of your own and transition words for flow; do not repeat your partner's part. Reply with your text only.",
            self.role(seat),
            reward.min_tokens,
            reward.max_tokens
        )
    }

    fn observation(&self, seat: SeatId) -> String {
        let label = match self.task {
            WritingTask::Arxiv => "Abstract",
            WritingTask::Tldr => "Post",
        };
        let mut text =
            format!("{label}:\n{}\n\nTurn {} of {}.", self.source(), self.turns.len() + 1, self.params.num_turns);
        if let Some(last) = self.turns.last() {
            let (own, other) = if seat == 0 { (&last.first, &last.second) } else { (&last.second, &last.first) };
            text.push_str(&format!(
                "\n\nYour last text:\n{own}\n\nYour partner's last text:\n{other}\n\nJoint reward last turn: {:.3} (level {} of 4). Revise your text.",
                last.scores.total, last.scores.level
            ));
        }
        text
    }

    fn legal_actions(&self, _seat: SeatId) -> Option<Vec<LegalAction>> {
        None
    }

    fn parse_action(&self, _seat: SeatId, text: &str) -> Result<Action, ActionError> {
        let lower = text.to_ascii_lowercase();
        let span = match lower.rfind("<answer>") {
            Some(open) => {
                let start = open + "<answer>".len();
                let end = lower[start..].find("</answer>").map_or(text.len(), |i| start + i);
                &text[start..end]
            }
            None => text,
        };
        let span = span.trim();
        if span.is_empty() {
            return Err(ActionError::Unparseable {
                text: text.chars().take(80).collect(),
                reason: "an empty text".to_string(),
            });
        }
        Ok(Action::Text(span.to_string()))
    }

    fn step(&mut self, actions: &[Action]) -> Result<Vec<f64>, ActionError> {
        let texts = crate::text::two_texts(actions, self.is_terminal(), "the writing task takes text")?;
        let scores = self.params.reward.score(texts[0], texts[1]);
        let reward = scores.total;
        self.turns.push(WritingTurn { first: texts[0].to_string(), second: texts[1].to_string(), scores });
        self.returns[0] += reward;
        self.returns[1] += reward;
        Ok(vec![reward, reward])
    }

    fn is_terminal(&self) -> bool {
        self.turns.len() >= self.params.num_turns
    }

    fn returns(&self) -> Vec<f64> {
        self.returns.to_vec()
    }

    fn metrics(&self) -> EpisodeMetrics {
        let scores = self.turns.last().map(|turn| turn.scores.clone()).unwrap_or_default();
        let mut metrics = EpisodeMetrics::new();
        for (name, value) in [
            ("score", scores.total),
            ("level", f64::from(scores.level)),
            ("level_structure", scores.structure),
            ("level_coordination", scores.coordination),
            ("level_vocabulary", scores.vocabulary),
            ("level_style", scores.style),
            ("tokens_0", scores.tokens[0] as f64),
            ("tokens_1", scores.tokens[1] as f64),
            ("length_ratio", scores.length_ratio),
            ("vocabulary_ratio", scores.vocabulary_ratio),
            ("jaccard", scores.jaccard),
            ("transition_categories", scores.transition_categories as f64),
            ("turns", self.turns.len() as f64),
        ] {
            metrics.insert(name.to_string(), value);
        }
        metrics
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
