//! A prompt's keys and values held once for the rows that share it (`runtime.prompt_cache`).
//!
//! A GRPO group decodes several replies to one prompt on one adapter. Its prompt is prefilled
//! once ([`crate::generate::prefix::SharedPrefixes`]); then either every row gets its own copy
//! of the prompt's keys and values (`copied`: [`super::KvCache::select_rows`], one cache
//! `[rows, kv_heads, prompt + reply room, head_dim]`), or the cache keeps the prompt once per
//! group beside each row's own reply room (`shared`: [`SharedPrompt`],
//! `[groups, kv_heads, prompt, head_dim]` and `[rows, kv_heads, reply room, head_dim]`), and
//! attention reads the two parts ([`attend`]): the queries' scores against their group's prompt
//! and against their own reply, one masked softmax over both, and each part's values weighted
//! by its probabilities, summed. At a GRPO rollout's shape (8 replies of 128 tokens to a
//! 384-token prompt) the shared cache is about a third of the copied one, and a decoding step
//! reads a third of the keys and values. The sums run in another order than one product over
//! the copied cache: the outputs agree within float rounding.
//!
//! The update scores a group's replies the same way: its prompt runs once and every reply
//! attends to it in place, under autodiff one node ([`tracked`]) that keeps no probabilities and
//! no per-row copy of the prompt, and recomputes the scores in its backward. Under activation
//! checkpointing ([`super::checkpoint`]) each recomputed layer reads its prompt in place too.

use burn::tensor::{Bool, DType, Device, Int, Tensor, TensorData};
use serde::{Deserialize, Serialize};

use crate::error::{Result, TroupeError};

mod tracked;

/// `runtime.prompt_cache`: how a generation's cache holds a prompt several rows share.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum PromptCache {
    /// `shared` on a GPU, `copied` on the CPU (whose fused attention reads one cache per row;
    /// the CPU's runs then compute exactly what they did before the choice existed).
    #[default]
    Auto,
    /// The prompt held once per group, attention over two parts.
    Shared,
    /// Every row holds its own copy of the prompt.
    Copied,
}

impl PromptCache {
    /// The name as the config writes it.
    pub fn name(self) -> &'static str {
        match self {
            PromptCache::Auto => "auto",
            PromptCache::Shared => "shared",
            PromptCache::Copied => "copied",
        }
    }

    /// Whether a generation on `device` holds shared prompts once (`auto`: off the CPU).
    pub fn shares_on(self, device: &Device) -> bool {
        match self {
            PromptCache::Auto => *device != Device::flex(),
            PromptCache::Shared => true,
            PromptCache::Copied => false,
        }
    }
}

/// Which rows read which group's prompt, as [`attend`] lays them out: the rows in groups of
/// `width`, group `g` at rows `g * width ..`. When the batch's rows already sit so (a GRPO
/// rollout's groups, contiguous and of one size) nothing moves; otherwise the queries are
/// gathered into that layout (a group short of `width` rows repeats one of its rows) and the
/// results gathered back.
#[derive(Clone, Debug)]
pub struct GroupLayout {
    /// Per row: its group.
    group_of_row: Vec<usize>,
    /// Number of groups.
    groups: usize,
    /// Rows per group in the layout (the largest group).
    width: usize,
    /// `[groups * width]`: the row at each place of the layout, when it is not the identity.
    order: Option<Tensor<1, Int>>,
    /// `[rows]`: each row's place in the layout, when it is not the identity.
    back: Option<Tensor<1, Int>>,
    /// `[groups * width]`: 1 at each place a row holds, 0 where a place repeats a row (a group
    /// short of `width` rows), when some place does.
    held: Option<Tensor<1>>,
    /// `[rows]`: `group_of_row` on the device, for the decoding step's kernel
    /// (`fused::gpu::decode_attention`), which reads each row's group in place of a layout.
    of_row: Tensor<1, Int>,
}

impl GroupLayout {
    /// The layout of rows whose groups are `group_of_row`, each in `0..groups` (a group without
    /// rows takes places in the layout that no row reads back).
    pub fn new(group_of_row: &[usize], groups: usize, device: &Device) -> Result<Self> {
        if let Some(&group) = group_of_row.iter().find(|&&g| g >= groups) {
            return Err(TroupeError::invalid("group_of_row", format!("group {group} of {groups} prompts")));
        }
        let mut members: Vec<Vec<usize>> = vec![Vec::new(); groups];
        for (row, &group) in group_of_row.iter().enumerate() {
            members[group].push(row);
        }
        let width = members.iter().map(Vec::len).max().unwrap_or(0);
        let mut order = Vec::with_capacity(groups * width);
        let mut back = vec![0i64; group_of_row.len()];
        let mut held = Vec::with_capacity(groups * width);
        for (g, rows) in members.iter().enumerate() {
            for i in 0..width {
                let row = rows.get(i).or(rows.first()).copied().unwrap_or(0);
                if i < rows.len() {
                    back[row] = (g * width + i) as i64;
                }
                order.push(row as i64);
                held.push(if i < rows.len() { 1.0f32 } else { 0.0 });
            }
        }
        let repeats = held.contains(&0.0);
        let held = repeats.then(|| Tensor::<1>::from_data(TensorData::new(held, [groups * width]), device));
        let identity = order.len() == group_of_row.len() && order.iter().enumerate().all(|(i, &r)| r == i as i64);
        let index = |values: Vec<i64>| {
            let len = values.len();
            Tensor::<1, Int>::from_data(TensorData::new(values, [len]), device)
        };
        let (order, back) = if identity { (None, None) } else { (Some(index(order)), Some(index(back))) };
        let of_row = index(group_of_row.iter().map(|&g| g as i64).collect());
        Ok(Self { group_of_row: group_of_row.to_vec(), groups, width, order, back, held, of_row })
    }

    /// The layout of a batch whose row `i` is this batch's row `rows[i]`, in the same groups.
    pub fn pick(&self, rows: &[usize], device: &Device) -> Self {
        let group_of_row: Vec<usize> = rows.iter().map(|&r| self.group_of_row[r]).collect();
        Self::new(&group_of_row, self.groups, device).expect("the rows' groups are this layout's")
    }

    /// The same layout with its index tensors outside autodiff (what an autodiff node keeps).
    fn without_autodiff(&self) -> Self {
        Self {
            group_of_row: self.group_of_row.clone(),
            order: self.order.clone().map(Tensor::without_autodiff),
            back: self.back.clone().map(Tensor::without_autodiff),
            held: self.held.clone().map(Tensor::without_autodiff),
            of_row: self.of_row.clone(),
            groups: self.groups,
            width: self.width,
        }
    }

    /// `t`'s rows (dimension 0) in the layout's order: `[rows, ..]` -> `[groups * width, ..]`.
    fn gather<const D: usize>(&self, t: Tensor<D>) -> Tensor<D> {
        match &self.order {
            Some(order) => t.select(0, order.clone()),
            None => t,
        }
    }

    /// The rows of `t` back in the batch's order: `[groups * width, ..]` -> `[rows, ..]`.
    fn scatter<const D: usize>(&self, t: Tensor<D>) -> Tensor<D> {
        match &self.back {
            Some(back) => t.select(0, back.clone()),
            None => t,
        }
    }

    /// `t`'s rows in the layout's order, each group's along a dimension of their own, as a
    /// product broadcast over a group's prompt ([`GroupLayout::per_group`]) reads them: a view
    /// after the gather, nothing copied.
    ///
    /// # Shapes
    /// `t`: `[rows, kv_heads, folded, x]` -> `[groups, width, kv_heads, folded, x]`
    fn grouped(&self, t: Tensor<4>) -> Tensor<5> {
        let [_, kv_heads, folded, last] = t.dims();
        self.gather(t).reshape([self.groups, self.width, kv_heads, folded, last])
    }

    /// The inverse of [`GroupLayout::grouped`], each row's place read back.
    ///
    /// # Shapes
    /// `t`: `[groups, width, kv_heads, folded, x]` -> `[rows, kv_heads, folded, x]`
    fn ungrouped(&self, t: Tensor<5>) -> Tensor<4> {
        let [groups, width, kv_heads, folded, last] = t.dims();
        self.scatter(t.reshape([groups * width, kv_heads, folded, last]))
    }

    /// A group's prompt (keys or values) broadcast over the group's rows of
    /// [`GroupLayout::grouped`].
    ///
    /// # Shapes
    /// `t`: `[groups, kv_heads, prompt, d]` -> `[groups, 1, kv_heads, prompt, d]`
    fn per_group(t: Tensor<4>) -> Tensor<5> {
        t.unsqueeze_dim(1)
    }

    /// Each group's sum over its rows, the places that repeat a row left out (each row then
    /// counts once): a prompt's gradient from its replies'.
    ///
    /// # Shapes
    /// `t`: `[groups, width, kv_heads, a, b]` -> `[groups, kv_heads, a, b]`
    fn sum_over_group(&self, t: Tensor<5>) -> Tensor<4> {
        let t = match &self.held {
            Some(held) => t * held.clone().reshape([self.groups, self.width, 1, 1, 1]),
            None => t,
        };
        t.sum_dim(1).squeeze_dim(1)
    }
}

/// The prompts of a shared cache: per layer, each group's keys and values once.
#[derive(Clone, Debug)]
pub struct SharedPrompt {
    /// Per layer: keys and values, each `[groups, kv_heads, prompt, head_dim]` (`None` at a
    /// layer not run, when one layer is recomputed alone under activation checkpointing).
    pub layers: Vec<Option<(Tensor<4>, Tensor<4>)>>,
    /// Which rows read which group's prompt.
    pub groups: GroupLayout,
}

impl SharedPrompt {
    /// Prompt slots per row.
    pub fn len(&self) -> usize {
        self.layers.iter().flatten().next().map_or(0, |(k, _)| k.dims()[2])
    }

    /// Whether no slot is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Masked grouped-query attention over a shared prompt and each row's own keys and values,
/// scale `1 / sqrt(head_dim)`: what attention over each row's copy of its group's prompt
/// followed by its own slots computes. The query heads of each key/value head are folded into
/// its rows, as the other attentions fold them, so no key or value head is repeated. A query
/// that may see no key gets zeros on a GPU and equal weights elsewhere (no generation asks
/// for one: every query sees its own slot or its prompt). Under autodiff (the update's scoring)
/// it is one node whose backward recomputes the probabilities ([`tracked`]); a decoding step
/// on a GPU (one query a row, no gradient) is one kernel (`fused::gpu::decode_attention`).
///
/// # Shapes
/// `q`: `[rows, heads, seq, head_dim]`; `prompt`: `[groups, kv_heads, prompt, head_dim]` each;
/// `own`: `[rows, kv_heads, reply, head_dim]` each; `mask`: `[rows, 1, seq, prompt + reply]`
/// (`true`: hidden) -> `[rows, heads, seq, head_dim]`
pub fn attend(
    q: Tensor<4>,
    prompt: (Tensor<4>, Tensor<4>),
    groups: &GroupLayout,
    own: (Tensor<4>, Tensor<4>),
    mask: &Tensor<4, Bool>,
) -> Tensor<4> {
    attend_rounded(q, prompt, groups, own, mask, None).0
}

/// [`attend`], and given `round` (the half precision of the output projection's product,
/// [`crate::model::layers::FrozenLinear::input_rounding`]) its output rounded to it where the
/// decoding step's kernel wrote that too (`None` for it elsewhere).
///
/// # Shapes
/// as [`attend`], the rounded output like the output
#[cfg_attr(not(any(feature = "cuda", feature = "wgpu")), allow(unused_variables))]
pub fn attend_rounded(
    q: Tensor<4>,
    prompt: (Tensor<4>, Tensor<4>),
    groups: &GroupLayout,
    own: (Tensor<4>, Tensor<4>),
    mask: &Tensor<4, Bool>,
    round: Option<DType>,
) -> (Tensor<4>, Option<Tensor<4>>) {
    let [rows, heads, seq, head_dim] = q.dims();
    let kv_heads = prompt.0.dims()[1];
    debug_assert_eq!(prompt.0.dims()[0], groups.groups, "one prompt per group");
    // A decoding step on a GPU: one kernel reading each row's group.
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    if let Some(out) = super::fused::gpu::decode_attention(
        &q,
        Some((&prompt.0, &prompt.1, &groups.of_row)),
        (&own.0, &own.1),
        mask,
        round,
    ) {
        return out;
    }
    // A cache held in half precision ([`crate::model::KvCache::holding`]) is read in f32.
    let widened = |t: Tensor<4>| crate::model::fused::attention::in_dtype(t, q.dtype());
    let (prompt, own) = ((widened(prompt.0), widened(prompt.1)), (widened(own.0), widened(own.1)));
    let parts = TwoParts { groups, mask, scale: (1.0 / (head_dim as f64).sqrt()) as f32 };
    // Query head `h` reads key/value head `h / (heads / kv_heads)`: `[rows, kv_heads, folded, d]`.
    let q = q.reshape([rows, kv_heads, heads / kv_heads * seq, head_dim]);
    let inputs = [q, prompt.0, prompt.1, own.0, own.1];
    let out = if inputs.iter().any(Tensor::is_autodiff) {
        match tracked::attend(&parts, &inputs) {
            Some(out) => out,
            // Autodiff through the operations (other backends): what the node computes.
            None => parts.forward(&inputs),
        }
    } else {
        parts.forward(&inputs)
    };
    (out.reshape([rows, heads, seq, head_dim]), None)
}

/// The two-part attention's fixed arguments: which rows read which prompt, the mask, the scale.
#[derive(Clone, Copy)]
struct TwoParts<'a> {
    groups: &'a GroupLayout,
    /// `[rows, 1, seq, prompt + reply]` (`true`: hidden)
    mask: &'a Tensor<4, Bool>,
    scale: f32,
}

impl TwoParts<'_> {
    /// The attention's output.
    ///
    /// # Shapes
    /// `[q, prompt_k, prompt_v, own_k, own_v]`: `[rows, kv_heads, folded, d]`, two
    /// `[groups, kv_heads, prompt, d]`, two `[rows, kv_heads, reply, d]` ->
    /// `[rows, kv_heads, folded, d]`
    fn forward(&self, [q, prompt_k, prompt_v, own_k, own_v]: &[Tensor<4>; 5]) -> Tensor<4> {
        let probs = self.probabilities(q, prompt_k, own_k);
        self.weighted(probs, prompt_v, own_v)
    }

    /// The probabilities over the prompt's keys and the row's own, joined: the scores of a
    /// group's rows against its prompt in one product, of every row against its own keys in
    /// another, one masked softmax over both.
    ///
    /// # Shapes
    /// `q`: `[rows, kv_heads, folded, d]`, `prompt_k`: `[groups, kv_heads, prompt, d]`, `own_k`:
    /// `[rows, kv_heads, reply, d]` -> `[rows, kv_heads, folded, prompt + reply]`
    fn probabilities(&self, q: &Tensor<4>, prompt_k: &Tensor<4>, own_k: &Tensor<4>) -> Tensor<4> {
        let groups = self.groups;
        let per_group = GroupLayout::per_group(prompt_k.clone()).swap_dims(3, 4);
        let prompt_scores = groups.ungrouped(groups.grouped(q.clone()).matmul(per_group));
        let own_scores = q.clone().matmul(own_k.clone().swap_dims(2, 3));
        masked_softmax(Tensor::cat(vec![prompt_scores, own_scores], 3), self.mask, self.scale)
    }

    /// Each part's values weighted by its probabilities, summed.
    ///
    /// # Shapes
    /// `probs`: `[rows, kv_heads, folded, prompt + reply]`, `prompt_v`:
    /// `[groups, kv_heads, prompt, d]`, `own_v`: `[rows, kv_heads, reply, d]` ->
    /// `[rows, kv_heads, folded, d]`
    fn weighted(&self, probs: Tensor<4>, prompt_v: &Tensor<4>, own_v: &Tensor<4>) -> Tensor<4> {
        let keys = probs.dims()[3];
        let prompt_len = prompt_v.dims()[2];
        let groups = self.groups;
        let p_prompt = groups.grouped(probs.clone().narrow(3, 0, prompt_len));
        let from_prompt = groups.ungrouped(p_prompt.matmul(GroupLayout::per_group(prompt_v.clone())));
        let from_own = probs.narrow(3, prompt_len, keys - prompt_len).matmul(own_v.clone());
        from_prompt + from_own
    }
}

/// `softmax(scores * scale)` over the keys `mask` leaves visible: troupe's kernel on a GPU,
/// burn's operations elsewhere.
///
/// # Shapes
/// `scores`: `[rows, kv_heads, folded, keys]`, `mask`: `[rows, 1, seq, keys]` with `folded` a
/// multiple of `seq` (score row `r` reads mask row `r % seq`) -> like `scores`
fn masked_softmax(scores: Tensor<4>, mask: &Tensor<4, Bool>, scale: f32) -> Tensor<4> {
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    if super::fused::gpu::takes(&scores) {
        return super::fused::gpu::masked_softmax(scores, mask, scale);
    }
    let folds = scores.dims()[2] / mask.dims()[2];
    let hidden = mask.clone().repeat_dim(2, folds);
    burn::tensor::activation::softmax((scores * scale).mask_fill(hidden, f32::MIN), 3)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_through_yaml_and_the_command_line() {
        for choice in [PromptCache::Auto, PromptCache::Shared, PromptCache::Copied] {
            let yaml = serde_yaml::to_string(&choice).unwrap();
            assert_eq!(yaml.trim(), choice.name());
            assert_eq!(serde_yaml::from_str::<PromptCache>(&yaml).unwrap(), choice);
            assert_eq!(<PromptCache as clap::ValueEnum>::from_str(choice.name(), true), Ok(choice));
        }
        let cpu = Device::flex();
        assert!(!PromptCache::Auto.shares_on(&cpu), "the CPU keeps its copies unless asked");
        assert!(PromptCache::Shared.shares_on(&cpu));
        assert!(!PromptCache::Copied.shares_on(&cpu));
    }

    #[test]
    fn a_layout_moves_nothing_for_contiguous_groups_of_one_size() {
        let device = Device::flex();
        let layout = GroupLayout::new(&[0, 0, 1, 1, 2, 2], 3, &device).unwrap();
        assert_eq!((layout.groups, layout.width), (3, 2));
        assert!(layout.order.is_none() && layout.back.is_none());
    }

    #[test]
    fn a_layout_gathers_scattered_and_uneven_groups_and_puts_them_back() {
        let device = Device::flex();
        // Group 0: rows 1, 3, 4; group 1: row 0; group 2: row 2.
        let layout = GroupLayout::new(&[1, 0, 2, 0, 0], 3, &device).unwrap();
        assert_eq!((layout.groups, layout.width), (3, 3));
        let err = GroupLayout::new(&[1, 3], 3, &device).unwrap_err().to_string();
        assert!(err.contains("group_of_row") && err.contains("group 3 of 3"), "{err}");
        let rows = Tensor::<1, Int>::from_data(TensorData::new(vec![10i64, 11, 12, 13, 14], [5]), &device).float();
        let gathered = layout.gather(rows.clone().reshape([5, 1])).reshape([9]);
        let expected = [11.0f32, 13.0, 14.0, 10.0, 10.0, 10.0, 12.0, 12.0, 12.0];
        assert_eq!(gathered.to_data().try_into_vec::<f32>().unwrap(), expected);
        let back = layout.scatter(gathered.reshape([9, 1])).reshape([5]);
        assert_eq!(back.into_data().try_into_vec::<f32>().unwrap(), rows.into_data().try_into_vec::<f32>().unwrap());
    }

    /// A mask where row `r` hides its first `r` prompt slots (left padding) and the reply slots
    /// past each query's own (causal, the room beyond unwritten).
    ///
    /// # Shapes
    /// -> `[rows, 1, seq, prompt_len + reply_len]`
    fn padded_causal_mask(
        rows: usize,
        seq: usize,
        prompt_len: usize,
        reply_len: usize,
        device: &Device,
    ) -> Tensor<4, Bool> {
        let keys = prompt_len + reply_len;
        let hidden: Vec<bool> = (0..rows)
            .flat_map(|r| {
                (0..seq)
                    .flat_map(move |i| (0..keys).map(move |key| key < r || (key >= prompt_len && key > prompt_len + i)))
            })
            .collect();
        Tensor::<4, Bool>::from_data(TensorData::new(hidden, [rows, 1, seq, keys]), device)
    }

    /// burn's attention over each row's copy of its group's prompt joined to its own keys and
    /// values: what [`attend`] computes without the copies.
    fn attend_each_rows_copy(
        q: Tensor<4>,
        (prompt_k, prompt_v): (Tensor<4>, Tensor<4>),
        group_of_row: &[usize],
        (own_k, own_v): (Tensor<4>, Tensor<4>),
        mask: &Tensor<4, Bool>,
    ) -> Tensor<4> {
        let index: Vec<i64> = group_of_row.iter().map(|&g| g as i64).collect();
        let index = Tensor::<1, Int>::from_data(TensorData::new(index, [group_of_row.len()]), &q.device());
        let k = Tensor::cat(vec![prompt_k.select(0, index.clone()), own_k], 2);
        let v = Tensor::cat(vec![prompt_v.select(0, index), own_v], 2);
        super::super::fused::grouped_attention(q, k, v, mask)
    }

    /// Attention over the two parts against attention over each row's copy of its prompt
    /// joined to its own keys (burn's attention), with query heads sharing key/value heads,
    /// scattered groups of different sizes, several queries per row and masked slots.
    #[test]
    fn attending_the_two_parts_matches_attending_each_rows_copy() {
        use burn::tensor::Distribution;
        let device = Device::flex();
        let (heads, kv_heads, seq, head_dim, prompt_len, reply_len) = (4, 2, 3, 8, 5, 6);
        let group_of_row = [1usize, 0, 1, 1, 2];
        let rows = group_of_row.len();
        let layout = GroupLayout::new(&group_of_row, 3, &device).unwrap();
        let random = |dims: [usize; 4]| Tensor::<4>::random(dims, Distribution::Normal(0.0, 1.0), &device);
        let q = random([rows, heads, seq, head_dim]);
        let (pk, pv) = (random([3, kv_heads, prompt_len, head_dim]), random([3, kv_heads, prompt_len, head_dim]));
        let (ok, ov) = (random([rows, kv_heads, reply_len, head_dim]), random([rows, kv_heads, reply_len, head_dim]));
        let mask = padded_causal_mask(rows, seq, prompt_len, reply_len, &device);
        let out = attend(q.clone(), (pk.clone(), pv.clone()), &layout, (ok.clone(), ov.clone()), &mask);

        let expected = attend_each_rows_copy(q, (pk, pv), &group_of_row, (ok, ov), &mask);
        let (got, want) =
            (out.into_data().try_into_vec::<f32>().unwrap(), expected.into_data().try_into_vec::<f32>().unwrap());
        assert_eq!(got.len(), want.len());
        let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(worst < 1e-5, "largest difference {worst}");
    }

    /// Under autodiff the two-part attention is one node that recomputes its probabilities in
    /// the backward: its output and the gradients of the queries, each group's prompt keys and
    /// values and each row's own, against burn's autodiff through attention over each row's
    /// copy of its prompt joined to its own keys (the copies' gradients summed into the prompt
    /// they came from). Scattered groups of uneven sizes (places that repeat a row), grouped
    /// query heads, left padding and causal masking; a group without rows gets no gradient.
    #[test]
    fn the_two_part_attentions_gradients_match_autodiff_through_each_rows_copy() {
        use burn::tensor::Distribution;
        let device = Device::flex().autodiff();
        let (heads, kv_heads, seq, head_dim, prompt_len, reply_len) = (4, 2, 3, 8, 5, 6);
        let group_of_row = [1usize, 0, 1, 1, 3];
        let (rows, groups) = (group_of_row.len(), 4);
        let layout = GroupLayout::new(&group_of_row, groups, &device).unwrap();
        assert!(layout.held.is_some(), "some places repeat a row");
        let random = |dims: [usize; 4]| Tensor::<4>::random(dims, Distribution::Normal(0.0, 1.0), &device);
        let inputs = [
            random([rows, heads, seq, head_dim]),
            random([groups, kv_heads, prompt_len, head_dim]),
            random([groups, kv_heads, prompt_len, head_dim]),
            random([rows, kv_heads, reply_len, head_dim]),
            random([rows, kv_heads, reply_len, head_dim]),
        ];
        let mask = padded_causal_mask(rows, seq, prompt_len, reply_len, &device);
        let weights = random([rows, heads, seq, head_dim]);
        let leaves = || inputs.clone().map(|t| t.detach().require_grad());
        let values = |t: Tensor<4>| t.into_data().try_into_vec::<f32>().unwrap();

        let ours = leaves();
        let [q, pk, pv, ok, ov] = ours.clone();
        // The node takes these tensors (else `attend` differentiates its operations).
        let folded = q.clone().reshape([rows, kv_heads, heads / kv_heads * seq, head_dim]);
        let parts = TwoParts { groups: &layout, mask: &mask, scale: (1.0 / (head_dim as f64).sqrt()) as f32 };
        let node_inputs = [folded, pk.clone(), pv.clone(), ok.clone(), ov.clone()];
        assert!(tracked::attend(&parts, &node_inputs).is_some(), "the node runs on the CPU");
        let out = attend(q, (pk, pv), &layout, (ok, ov), &mask);
        let got_out = values(out.clone().detach());
        let grads = (out * weights.clone()).sum().backward();

        let theirs = leaves();
        let [q, pk, pv, ok, ov] = theirs.clone();
        let expected = attend_each_rows_copy(q, (pk, pv), &group_of_row, (ok, ov), &mask);
        let want_out = values(expected.clone().detach());
        let expected_grads = (expected * weights).sum().backward();

        let worst = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
        assert!(worst(&got_out, &want_out) < 1e-5, "output off by {}", worst(&got_out, &want_out));
        for (i, name) in ["q", "prompt_k", "prompt_v", "own_k", "own_v"].into_iter().enumerate() {
            let got = values(ours[i].grad(&grads).expect("a gradient"));
            let want = values(theirs[i].grad(&expected_grads).expect("a gradient"));
            let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            assert!(scale > 1e-3, "{name}: the gradient is not trivially zero");
            assert!(worst(&got, &want) < 1e-5 * scale.max(1.0), "{name}: off by {}", worst(&got, &want));
            if name.starts_with("prompt") {
                // Group 2 has no rows: its prompt gets no gradient.
                let group = prompt_len * kv_heads * head_dim;
                assert!(got[2 * group..3 * group].iter().all(|&g| g == 0.0), "{name}: group 2 untouched");
            }
        }
    }
}
