//! Constrained decoding: a row may only spell one of a finite set of token sequences (the legal
//! actions of a game, in `constrained` action mode). The sequences form a [`TokenTrie`]; at every
//! decoding step the row's logits are restricted to the children of its current node and the
//! next token is sampled from that restricted distribution with the usual temperature, top-k and
//! top-p ([`super::sampler`]).
//!
//! A sequence that is a proper prefix of another stays reachable through the trie's EOS token:
//! at a node that both completes a sequence and has children, EOS is allowed too and ends the
//! row with the shorter sequence. A node that completes a sequence and has no children ends the
//! row as soon as it is reached (no EOS is decoded there unless EOS is itself the sequence's last
//! token, which is how the rollout builds its tries).

use rand_chacha::ChaCha8Rng;

use super::sampler::{self, SamplingConfig};
use crate::error::{Result, TroupeError};

/// A node of a [`TokenTrie`], by index; [`TokenTrie::ROOT`] is where every row starts.
pub type NodeId = usize;

/// One trie node: its children by token (ascending) and the sequence it completes, if any.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Node {
    children: Vec<(u32, NodeId)>,
    sequence: Option<usize>,
}

/// What decoding a token at a node leads to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TrieStep {
    /// The row goes on from this node.
    Continue(NodeId),
    /// The row has spelled sequence `sequence` (an index into the list the trie was built from)
    /// and is finished.
    Complete {
        /// Index of the spelled sequence.
        sequence: usize,
    },
}

/// The token sequences one row may decode, as a trie.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenTrie {
    nodes: Vec<Node>,
    eos: Option<u32>,
    num_sequences: usize,
    max_token: u32,
}

impl TokenTrie {
    /// The node every row starts at.
    pub const ROOT: NodeId = 0;

    /// Builds the trie of `sequences` (each non-empty, no two equal). `eos` ends a sequence that
    /// is a proper prefix of another; without it such a set is refused, as the shorter sequence
    /// could never be chosen. A sequence `s` alongside `s + [eos]` is refused too (ambiguous).
    pub fn new(sequences: &[Vec<u32>], eos: Option<u32>) -> Result<Self> {
        if sequences.is_empty() {
            return Err(TroupeError::invalid("sequences", "a constraint needs at least one sequence"));
        }
        let mut nodes = vec![Node::default()];
        let mut max_token = eos.unwrap_or(0);
        for (index, sequence) in sequences.iter().enumerate() {
            if sequence.is_empty() {
                return Err(TroupeError::invalid("sequences", format!("sequence {index} is empty")));
            }
            let mut node = Self::ROOT;
            for &token in sequence {
                max_token = max_token.max(token);
                node = match nodes[node].children.binary_search_by_key(&token, |c| c.0) {
                    Ok(at) => nodes[node].children[at].1,
                    Err(at) => {
                        nodes.push(Node::default());
                        let child = nodes.len() - 1;
                        nodes[node].children.insert(at, (token, child));
                        child
                    }
                };
            }
            if let Some(other) = nodes[node].sequence {
                return Err(TroupeError::invalid(
                    "sequences",
                    format!("sequences {other} and {index} are the same tokens {sequence:?}"),
                ));
            }
            nodes[node].sequence = Some(index);
        }
        for node in &nodes {
            if let (Some(sequence), false) = (node.sequence, node.children.is_empty()) {
                let why = match eos {
                    None => "is a prefix of another and there is no EOS token to end it",
                    Some(eos) if node.children.iter().any(|c| c.0 == eos) => "is also listed with EOS appended",
                    Some(_) => continue,
                };
                return Err(TroupeError::invalid("sequences", format!("sequence {sequence} {why}")));
            }
        }
        Ok(Self { nodes, eos, num_sequences: sequences.len(), max_token })
    }

    /// Number of sequences the trie was built from.
    pub fn num_sequences(&self) -> usize {
        self.num_sequences
    }

    /// The largest token id the trie can emit (EOS included): it must be below the model's vocab.
    pub fn max_token(&self) -> u32 {
        self.max_token
    }

    /// The tokens allowed at `node`, ascending: its children, plus EOS where the node completes
    /// a sequence and has children.
    pub fn allowed(&self, node: NodeId) -> Vec<u32> {
        let n = &self.nodes[node];
        let mut tokens: Vec<u32> = n.children.iter().map(|c| c.0).collect();
        if let (Some(eos), Some(_), false) = (self.eos, n.sequence, n.children.is_empty()) {
            let at = tokens.partition_point(|&t| t < eos);
            tokens.insert(at, eos);
        }
        tokens
    }

    /// Where decoding `token` at `node` leads, or `None` when `token` is not allowed there.
    pub fn advance(&self, node: NodeId, token: u32) -> Option<TrieStep> {
        let n = &self.nodes[node];
        if let Ok(at) = n.children.binary_search_by_key(&token, |c| c.0) {
            let child = n.children[at].1;
            let c = &self.nodes[child];
            return Some(match (c.sequence, c.children.is_empty()) {
                (Some(sequence), true) => TrieStep::Complete { sequence },
                _ => TrieStep::Continue(child),
            });
        }
        match n.sequence {
            Some(sequence) if Some(token) == self.eos => Some(TrieStep::Complete { sequence }),
            _ => None,
        }
    }

    /// The index of the sequence `tokens` spells when decoded from the root (with the EOS that
    /// ends a prefix sequence), or `None` if it spells none completely.
    pub fn lookup(&self, tokens: &[u32]) -> Option<usize> {
        let mut node = Self::ROOT;
        for (i, &token) in tokens.iter().enumerate() {
            match self.advance(node, token)? {
                TrieStep::Continue(next) => node = next,
                TrieStep::Complete { sequence } => return (i + 1 == tokens.len()).then_some(sequence),
            }
        }
        None
    }

    /// Picks the next token at `node` from one row of logits (`[vocab]`, every allowed id in
    /// range), sampling with `sampling` among the allowed tokens only: the same as setting every
    /// other logit to minus infinity, without touching the rest of the vocabulary. A node with
    /// one allowed token returns it without drawing from `rng`. Greedy takes the allowed token
    /// with the largest logit (the smallest id on ties, as an unconstrained argmax would).
    pub fn pick(&self, node: NodeId, logits: &[f32], sampling: &SamplingConfig, rng: &mut ChaCha8Rng) -> u32 {
        let allowed = self.allowed(node);
        if allowed.len() == 1 {
            return allowed[0];
        }
        let restricted: Vec<f32> = allowed.iter().map(|&t| logits[t as usize]).collect();
        allowed[sampler::sample(&restricted, sampling, rng) as usize]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    const EOS: u32 = 2;

    /// Walks `tokens` from the root, as generation does.
    fn walk(trie: &TokenTrie, tokens: &[u32]) -> Option<TrieStep> {
        let mut step = TrieStep::Continue(TokenTrie::ROOT);
        for &t in tokens {
            let TrieStep::Continue(node) = step else { return None };
            step = trie.advance(node, t)?;
        }
        Some(step)
    }

    #[test]
    fn allowed_tokens_are_exactly_the_children() {
        let trie = TokenTrie::new(&[vec![5, 6, 7], vec![5, 8], vec![9], vec![5, 6, 4]], Some(EOS)).unwrap();
        assert_eq!(trie.num_sequences(), 4);
        assert_eq!(trie.max_token(), 9);
        assert_eq!(trie.allowed(TokenTrie::ROOT), vec![5, 9]);
        let Some(TrieStep::Continue(after5)) = walk(&trie, &[5]) else { panic!("5 goes on") };
        assert_eq!(trie.allowed(after5), vec![6, 8]);
        let Some(TrieStep::Continue(after56)) = walk(&trie, &[5, 6]) else { panic!("5 6 goes on") };
        assert_eq!(trie.allowed(after56), vec![4, 7], "no EOS: [5, 6] is not a sequence");
        assert_eq!(trie.advance(TokenTrie::ROOT, 6), None);
        assert_eq!(trie.advance(TokenTrie::ROOT, EOS), None);
        assert_eq!(walk(&trie, &[9]), Some(TrieStep::Complete { sequence: 2 }));
        assert_eq!(walk(&trie, &[5, 6, 4]), Some(TrieStep::Complete { sequence: 3 }));
        assert_eq!((trie.lookup(&[5, 8]), trie.lookup(&[5]), trie.lookup(&[5, 8, 1])), (Some(1), None, None));

        // Sampling at the root never leaves {5, 9}, even when every other logit is far larger.
        let mut logits = vec![10.0f32; 12];
        logits[5] = 0.0;
        logits[9] = -1.0;
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        let config = SamplingConfig { temperature: 1.0, top_k: 3, top_p: 0.99 };
        let picks: Vec<u32> = (0..400).map(|_| trie.pick(TokenTrie::ROOT, &logits, &config, &mut rng)).collect();
        assert!(picks.iter().all(|t| [5, 9].contains(t)));
        // softmax([0, -1]) puts 0.73 on token 5.
        let fives = picks.iter().filter(|&&t| t == 5).count() as f64 / 400.0;
        assert!((fives - 0.731).abs() < 0.07, "{fives}");
        assert_eq!(trie.pick(TokenTrie::ROOT, &logits, &SamplingConfig::greedy(), &mut rng), 5);
    }

    #[test]
    fn prefix_sequences_stay_reachable_through_eos() {
        let trie = TokenTrie::new(&[vec![5], vec![5, 6], vec![5, 6, 7]], Some(EOS)).unwrap();
        let Some(TrieStep::Continue(after5)) = walk(&trie, &[5]) else { panic!("5 goes on") };
        assert_eq!(trie.allowed(after5), vec![EOS, 6]);
        assert_eq!(walk(&trie, &[5, EOS]), Some(TrieStep::Complete { sequence: 0 }));
        assert_eq!(walk(&trie, &[5, 6, EOS]), Some(TrieStep::Complete { sequence: 1 }));
        assert_eq!(walk(&trie, &[5, 6, 7]), Some(TrieStep::Complete { sequence: 2 }));
        assert_eq!(trie.lookup(&[5, 6, EOS]), Some(1));
        // Uniform logits: every sequence is sampled.
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let mut seen = [0usize; 3];
        for _ in 0..300 {
            let mut node = TokenTrie::ROOT;
            loop {
                let token = trie.pick(node, &[0.0; 8], &SamplingConfig::default(), &mut rng);
                match trie.advance(node, token).expect("picked tokens are allowed") {
                    TrieStep::Continue(next) => node = next,
                    TrieStep::Complete { sequence } => {
                        seen[sequence] += 1;
                        break;
                    }
                }
            }
        }
        assert!(seen.iter().all(|&n| n > 30), "{seen:?}");
    }

    #[test]
    fn unusable_sequence_sets_are_refused() {
        let refused =
            |sequences: &[Vec<u32>], eos: Option<u32>| TokenTrie::new(sequences, eos).unwrap_err().to_string();
        assert!(refused(&[], Some(EOS)).contains("at least one"));
        assert!(refused(&[vec![1], vec![]], Some(EOS)).contains("sequence 1 is empty"));
        assert!(refused(&[vec![1, 3], vec![4], vec![1, 3]], Some(EOS)).contains("sequences 0 and 2"));
        assert!(refused(&[vec![1], vec![1, 3]], None).contains("no EOS"));
        assert!(refused(&[vec![1], vec![1, EOS]], Some(EOS)).contains("EOS appended"));
        // The rollout's shape: every sequence ends with EOS, so none needs the prefix rule.
        let trie = TokenTrie::new(&[vec![1, EOS], vec![1, 3, EOS]], Some(EOS)).unwrap();
        assert_eq!(walk(&trie, &[1, EOS]), Some(TrieStep::Complete { sequence: 0 }));
    }
}
