//! The credit phase: what each reply or decision of a rollout earned. Reward functions and
//! processors ([`rewards`], [`external_reward`]) give every seat its episode reward, shaped per
//! step ([`shaped_step_rewards`]) so step-level credit survives; returns are discounted per turn
//! ([`turn_returns`]) and compared within their group ([`advantage`]) into the
//! [`batch::TrainBatch`] the update trains on.

pub mod advantage;
pub mod batch;
pub mod external_reward;
pub mod rewards;

use std::collections::{BTreeMap, BTreeSet};

use troupe_envs::{RegisteredReward, Registry, RewardInput};

use crate::error::{Result, TroupeError};
use crate::model::TextTokenizer;
use crate::rl::config::TrainConfig;
use crate::rl::rollout::EpisodeRecord;
use advantage::mean_std;
use batch::{AdvantageSettings, TrainBatch};
use external_reward::{ExternalRewards, RewardItem};
use rewards::{RewardFunction, RewardPipeline, SeatOutcome};

/// Every episode's shaped rewards, `[group][episode][seat][step]` ([`shaped_step_rewards`]).
pub type ShapedRewards = Vec<Vec<Vec<Vec<f64>>>>;

/// The credit phase: the reward pipeline (built-in, registered and external functions, then
/// processors), the discount and the advantage estimator, over one run's seats.
pub struct Credit {
    rewards: RewardPipeline,
    /// The external reward processes the pipeline lists (started once, for the run).
    external: ExternalRewards,
    /// The registered reward functions the pipeline lists, in order, with their names.
    registered: Vec<(String, RegisteredReward)>,
    gamma: f64,
    advantage: AdvantageSettings,
    seat_agents: Vec<usize>,
    /// Per seating of `training.partners`, the seats fixed partners play.
    partners: Vec<BTreeSet<usize>>,
}

/// What the credit phase gives the update: the batch, and its statistics.
pub struct Credited {
    /// One row per reply or decision, with its advantage.
    pub batch: TrainBatch,
    /// The agents' returns.
    pub stats: CreditStats,
    /// Every episode's shaped rewards, `[group][episode][seat][step]`.
    pub shaped: ShapedRewards,
}

/// What [`Credit::score_episodes`] gives.
#[derive(Clone, Debug, PartialEq)]
pub struct EpisodeScores {
    /// Every seat's processed reward: `[episode][seat]`.
    pub rewards: Vec<Vec<f64>>,
    /// Each reward function by label, with its value for each episode.
    pub functions: Vec<(String, Vec<f64>)>,
}

/// The credit phase's statistics: per agent, the mean and std over episodes of the summed
/// shaped rewards of the seats it plays (penalties included); per reward function, the mean and
/// std over episodes of its own value ([`Credit::score_episodes`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CreditStats {
    /// Per agent: mean return.
    pub mean_return: BTreeMap<usize, f64>,
    /// Per agent: std of the return.
    pub std_return: BTreeMap<usize, f64>,
    /// Per reward function, by label ([`RewardPipeline::labels`]): the mean of its unweighted
    /// value over the iteration's episodes.
    pub function_mean: BTreeMap<String, f64>,
    /// Per reward function, by label: the std of the same.
    pub function_std: BTreeMap<String, f64>,
}

impl CreditStats {
    /// `partners[g % len]`: the seats of group `g` played by fixed partners, not agents
    /// (`training.partners`; empty: every seat is an agent's).
    fn of(shaped: &ShapedRewards, seat_agents: &[usize], partners: &[BTreeSet<usize>]) -> Self {
        let mut stats = Self::default();
        let agents: BTreeSet<usize> = seat_agents.iter().copied().collect();
        for agent in agents {
            // An agent's return: the summed shaped rewards of the seats it plays, over the
            // episodes where it plays one.
            let mut returns = Vec::new();
            for (g, group) in shaped.iter().enumerate() {
                let partnered = partner_seats(partners, g);
                let seats: Vec<usize> = (0..seat_agents.len())
                    .filter(|seat| seat_agents[*seat] == agent && !partnered.is_some_and(|p| p.contains(seat)))
                    .collect();
                if seats.is_empty() {
                    continue;
                }
                for per_seat in group {
                    returns
                        .push(seats.iter().filter_map(|&seat| per_seat.get(seat)).map(|r| r.iter().sum::<f64>()).sum());
                }
            }
            if returns.is_empty() {
                continue;
            }
            let (m, s) = mean_std(&returns);
            stats.mean_return.insert(agent, m);
            stats.std_return.insert(agent, s);
        }
        stats
    }
}

/// The seats of group `g` played by fixed partners (`None` without partners).
fn partner_seats(partners: &[BTreeSet<usize>], g: usize) -> Option<&BTreeSet<usize>> {
    crate::rl::config::sections::seating_of_group(partners.len(), g).map(|seating| &partners[seating])
}

impl Credit {
    /// The credit phase of `config` (`rewards:`, `training.gamma`, the advantage settings,
    /// `agents.seats`), with registered reward functions from `registry`; external reward
    /// processes are started here.
    pub fn new(config: &TrainConfig, registry: &Registry) -> Result<Self> {
        let rewards = config.reward_pipeline()?;
        let mut registered = Vec::new();
        for function in rewards.functions() {
            if let RewardFunction::Registered(name) = &function.name {
                let found = registry.reward(name).ok_or_else(|| {
                    TroupeError::setting("rewards.functions", format!("no reward function {name:?} is registered"))
                })?;
                registered.push((name.clone(), found));
            }
        }
        let external = ExternalRewards::start(&rewards)?;
        Ok(Self {
            rewards,
            external,
            registered,
            gamma: config.training.gamma,
            advantage: config.training.advantage_settings(),
            seat_agents: config.agents.seats.clone(),
            partners: config.training.partners.iter().map(|p| p.keys().copied().collect()).collect(),
        })
    }

    /// The computed reward functions' values for `episodes`, `[episode][seat][function]` in the
    /// pipeline's order: registered per-seat functions called per seat, registered batch
    /// functions once with every episode, external ones with one exchange per function (empty
    /// lists when there is none).
    pub(crate) fn computed_reward_values(
        &self,
        tokenizer: &TextTokenizer,
        episodes: &[&EpisodeRecord],
    ) -> Result<Vec<Vec<Vec<f64>>>> {
        if self.external.is_empty() && self.registered.is_empty() {
            return Ok(episodes.iter().map(|e| vec![Vec::new(); e.env_returns.len()]).collect());
        }
        let decode = |ids: &[u32]| tokenizer.decode(ids, true);
        // Per-seat functions read completions alone; the others are sent the prompts too.
        let with_prompts =
            !self.external.is_empty() || self.registered.iter().any(|(_, f)| matches!(f, RegisteredReward::Batch(_)));
        let mut items = Vec::with_capacity(episodes.len());
        for episode in episodes {
            let seats = episode.env_returns.len();
            let (mut completions, mut prompts) = (vec![Vec::new(); seats], vec![Vec::new(); seats]);
            for turn in episode.turns.iter().filter(|t| t.seat < seats) {
                completions[turn.seat].push(decode(&turn.completion_ids)?);
                if with_prompts {
                    prompts[turn.seat].push(decode(&turn.prompt_ids)?);
                }
            }
            items.push(RewardItem {
                seed: episode.seed,
                completions,
                prompts,
                returns: episode.env_returns.clone(),
                metrics: episode.metrics.clone(),
            });
        }
        let external = self.external.score(&items)?;
        // Each batch function's `[episode][seat]` values (None for per-seat functions).
        let batched: Vec<Option<Vec<Vec<f64>>>> = self
            .registered
            .iter()
            .map(|(name, function)| match function {
                RegisteredReward::Seat(_) => Ok(None),
                RegisteredReward::Batch(f) => batch_reward_values(name, f(&items), &items).map(Some),
            })
            .collect::<Result<_>>()?;
        let mut values = Vec::with_capacity(items.len());
        for (e, ((item, episode), external)) in items.iter().zip(episodes).zip(external).enumerate() {
            let mut per_seat = Vec::with_capacity(item.returns.len());
            for (seat, external) in external.into_iter().enumerate() {
                let invalid_actions = episode.turns.iter().filter(|t| t.seat == seat && t.invalid).count();
                let input = RewardInput {
                    seat,
                    env_return: item.returns[seat],
                    invalid_actions,
                    metrics: &item.metrics,
                    completions: &item.completions[seat],
                };
                let (mut external, mut registered) = (external.into_iter(), self.registered.iter().zip(&batched));
                let mut seat_values = Vec::new();
                for function in self.rewards.computed_functions() {
                    let value = match function.name {
                        RewardFunction::External => external.next(),
                        _ => registered.next().map(|((_, f), batch)| match (f, batch) {
                            (RegisteredReward::Seat(f), _) => f(&input),
                            (RegisteredReward::Batch(_), Some(values)) => values[e][seat],
                            (RegisteredReward::Batch(_), None) => f64::NAN,
                        }),
                    };
                    let value = value.ok_or_else(|| TroupeError::reward(function.name.name(), "gave no value"))?;
                    if !value.is_finite() {
                        return Err(TroupeError::reward(function.name.name(), format!("gave {value} for seat {seat}")));
                    }
                    seat_values.push(value);
                }
                per_seat.push(seat_values);
            }
            values.push(per_seat);
        }
        Ok(values)
    }

    /// What the reward pipeline gives each of `episodes` (what an evaluation of the trained
    /// reward reports), with one exchange per external function: every seat's reward (reward
    /// functions, weights and processors, summed over the episode's steps), and each reward
    /// function's own value per episode, by label, in the pipeline's order: the mean of its
    /// unweighted values over `seats` (the seats the agents play; every seat when empty).
    pub fn score_episodes(
        &self,
        tokenizer: &TextTokenizer,
        episodes: &[EpisodeRecord],
        seats: &[usize],
    ) -> Result<EpisodeScores> {
        let refs: Vec<&EpisodeRecord> = episodes.iter().collect();
        let computed = self.computed_reward_values(tokenizer, &refs)?;
        let rewards = episodes
            .iter()
            .zip(&computed)
            .map(|(e, values)| {
                let shaped = shaped_step_rewards(e, &self.rewards, values)?;
                Ok(shaped.iter().map(|steps| steps.iter().sum()).collect())
            })
            .collect::<Result<_>>()?;
        let functions = function_episode_values(&self.rewards, &refs, &computed, seats)?;
        Ok(EpisodeScores { rewards, functions })
    }

    /// The credit phase: every episode's rewards shaped per step and seat, discounted into each
    /// turn's return, and turned into the batch's advantages.
    pub fn assign(&self, tokenizer: &TextTokenizer, groups: &[Vec<EpisodeRecord>]) -> Result<Credited> {
        let episodes: Vec<&EpisodeRecord> = groups.iter().flatten().collect();
        let computed_all = self.computed_reward_values(tokenizer, &episodes)?;
        let mut computed = computed_all.iter();
        let shaped: ShapedRewards = groups
            .iter()
            .map(|g| {
                g.iter()
                    .map(|e| shaped_step_rewards(e, &self.rewards, computed.next().map_or(&[][..], Vec::as_slice)))
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<_>>()?;
        let returns: Vec<Vec<Vec<f64>>> = groups
            .iter()
            .zip(&shaped)
            .map(|(g, s)| g.iter().zip(s).map(|(e, r)| turn_returns(e, r, self.gamma)).collect())
            .collect();
        let batch = TrainBatch::from_groups(groups, &returns, &self.seat_agents, self.advantage);
        let mut stats = CreditStats::of(&shaped, &self.seat_agents, &self.partners);
        // Over the seats the agents play: every seat, or those fixed partners leave them.
        let mut function_values: Vec<(String, Vec<f64>)> = Vec::new();
        let mut first = 0;
        for (g, group) in groups.iter().enumerate() {
            let seats: Vec<usize> = match partner_seats(&self.partners, g) {
                Some(partnered) => (0..self.seat_agents.len()).filter(|s| !partnered.contains(s)).collect(),
                None => Vec::new(),
            };
            let range = first..first + group.len();
            first = range.end;
            let computed = computed_all.get(range.clone()).unwrap_or(&[]);
            let values = function_episode_values(&self.rewards, &episodes[range], computed, &seats)?;
            if function_values.is_empty() {
                function_values = values;
            } else {
                for ((_, all), (_, more)) in function_values.iter_mut().zip(values) {
                    all.extend(more);
                }
            }
        }
        for (label, values) in function_values {
            let (mean, std) = mean_std(&values);
            stats.function_mean.insert(label.clone(), mean);
            stats.function_std.insert(label, std);
        }
        Ok(Credited { batch, stats, shaped })
    }
}

/// A batch reward function's answer for `items` as `[episode][seat]`: one value per episode
/// (every seat gets it) or one per seat, else an error naming the function.
fn batch_reward_values(
    name: &str,
    answer: std::result::Result<Vec<Vec<f64>>, String>,
    items: &[RewardItem],
) -> Result<Vec<Vec<f64>>> {
    let answer = answer.map_err(|message| TroupeError::reward(name, message))?;
    if answer.len() != items.len() {
        return Err(TroupeError::reward(name, format!("gave {} rewards for {} episodes", answer.len(), items.len())));
    }
    answer
        .into_iter()
        .zip(items)
        .enumerate()
        .map(|(e, (values, item))| {
            let seats = item.returns.len();
            match values.len() {
                1 => Ok(vec![values[0]; seats]),
                n if n == seats => Ok(values),
                n => Err(TroupeError::reward(
                    name,
                    format!("gave {n} values for episode {e}; give one, or one per seat ({seats})"),
                )),
            }
        })
        .collect()
}

/// Each function of `pipeline`, by label, with its value for each of `episodes`: the mean over
/// `seats` (every seat when empty) of the function's unweighted value for the seat.
/// `computed[e]` holds episode `e`'s computed values ([`Credit::computed_reward_values`]).
fn function_episode_values(
    pipeline: &RewardPipeline,
    episodes: &[&EpisodeRecord],
    computed: &[Vec<Vec<f64>>],
    seats: &[usize],
) -> Result<Vec<(String, Vec<f64>)>> {
    let labels = pipeline.labels();
    let mut per_function = vec![Vec::with_capacity(episodes.len()); labels.len()];
    for (e, episode) in episodes.iter().enumerate() {
        let values = seat_function_values(episode, pipeline, computed.get(e).map_or(&[][..], Vec::as_slice))?;
        let counted: Vec<&Vec<f64>> = if seats.is_empty() {
            values.iter().collect()
        } else {
            seats.iter().filter_map(|&seat| values.get(seat)).collect()
        };
        if counted.is_empty() {
            continue;
        }
        for (f, column) in per_function.iter_mut().enumerate() {
            column.push(counted.iter().map(|v| v[f]).sum::<f64>() / counted.len() as f64);
        }
    }
    Ok(labels.into_iter().zip(per_function).collect())
}

/// Each seat's environment return (the step rewards, plus its invalid-reply penalties) and
/// count of invalid replies in `episode`: what the reward functions read ([`SeatOutcome`]).
fn seat_totals(episode: &EpisodeRecord) -> (Vec<f64>, Vec<usize>) {
    let seats = episode.env_returns.len();
    let steps = episode.step_rewards.len();
    let mut env_return: Vec<f64> =
        (0..seats).map(|seat| episode.step_rewards.iter().map(|r| r.get(seat).copied().unwrap_or(0.0)).sum()).collect();
    let mut invalid = vec![0usize; seats];
    for turn in episode.turns.iter().filter(|t| t.seat < seats && t.step < steps) {
        env_return[turn.seat] += turn.penalty;
        invalid[turn.seat] += usize::from(turn.invalid);
    }
    (env_return, invalid)
}

/// Every function's own (unweighted) value for every seat of `episode`: `[seat][function]`, in
/// the pipeline's order. `computed[seat]` holds the computed functions' values for the seat.
pub fn seat_function_values(
    episode: &EpisodeRecord,
    pipeline: &RewardPipeline,
    computed: &[Vec<f64>],
) -> Result<Vec<Vec<f64>>> {
    let (env_return, invalid) = seat_totals(episode);
    env_return
        .iter()
        .zip(&invalid)
        .enumerate()
        .map(|(seat, (&env_return, &invalid_actions))| {
            pipeline.function_values(&SeatOutcome {
                env_return,
                invalid_actions,
                metrics: &episode.metrics,
                computed: computed.get(seat).map_or(&[][..], Vec::as_slice),
            })
        })
        .collect()
}

/// Every seat's reward at every step of `episode` under the configured pipeline: `[seat][step]`.
/// `external[seat]` holds the external reward functions' values for the seat (empty when the
/// pipeline has none).
///
/// A seat's reward at a step is `w_env x (its environment reward there)`, plus at its own turns
/// `w_env x (the invalid-reply penalty)` and `-w_invalid` for an invalid reply; the episode's last
/// step also gets the difference the `score` function and the processors make to the seat's
/// total, so a seat's rewards sum to its processed episode reward while step-level credit
/// survives. Every seat sees every step, so in a cooperative game a seat is credited with what
/// its partners score after its move (with identity processors and `env_return` alone, a seat's
/// rewards are exactly its environment rewards plus penalties).
pub fn shaped_step_rewards(
    episode: &EpisodeRecord,
    pipeline: &RewardPipeline,
    external: &[Vec<f64>],
) -> Result<Vec<Vec<f64>>> {
    let weight = |f: RewardFunction| pipeline.functions().iter().filter(|w| w.name == f).map(|w| w.weight).sum::<f64>();
    let (w_env, w_invalid) = (weight(RewardFunction::EnvReturn), weight(RewardFunction::InvalidActions));
    let seats = episode.env_returns.len();
    let steps = episode.step_rewards.len();
    let mut rewards: Vec<Vec<f64>> = (0..seats)
        .map(|seat| episode.step_rewards.iter().map(|r| w_env * r.get(seat).copied().unwrap_or(0.0)).collect())
        .collect();
    for turn in episode.turns.iter().filter(|t| t.seat < seats && t.step < steps) {
        rewards[turn.seat][turn.step] += w_env * turn.penalty - if turn.invalid { w_invalid } else { 0.0 };
    }
    let (env_return, invalid) = seat_totals(episode);
    if steps > 0 {
        for seat in 0..seats {
            let values = external.get(seat).map_or(&[][..], Vec::as_slice);
            let outcome = SeatOutcome {
                env_return: env_return[seat],
                invalid_actions: invalid[seat],
                metrics: &episode.metrics,
                computed: values,
            };
            let processed = pipeline.reward(&outcome)?;
            let so_far: f64 = rewards[seat].iter().sum();
            rewards[seat][steps - 1] += processed - so_far;
        }
    }
    Ok(rewards)
}

/// Each turn's discounted return-to-go, in turn order: the acting seat's shaped rewards
/// (`shaped[seat][step]`, from [`shaped_step_rewards`]) from the turn's step on, discounted by
/// `gamma` per environment step.
pub fn turn_returns(episode: &EpisodeRecord, shaped: &[Vec<f64>], gamma: f64) -> Vec<f64> {
    let to_go: Vec<Vec<f64>> = shaped.iter().map(|r| advantage::discounted_returns(r, gamma)).collect();
    episode.turns.iter().map(|t| to_go.get(t.seat).and_then(|r| r.get(t.step)).copied().unwrap_or(0.0)).collect()
}
