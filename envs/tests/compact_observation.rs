//! The compact Hanabi observation holds every piece of information the verbose one holds:
//! decoded back from its text, it gives the state's fireworks, tokens, deck, discards, every
//! hand (one's own as hint knowledge, the others' cards and their knowledge), the latest moves
//! and exactly the legal moves, in states reached by random play across seeds and player
//! counts. And every compact legal action's text (with its note) parses back to its move.

use std::collections::BTreeSet;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use troupe_envs::hanabi::{CardKnowledge, Event, HanabiEnv, HanabiState, Move};
use troupe_envs::{Action, Environment};

const COLORS: [char; 5] = ['R', 'Y', 'G', 'W', 'B'];
const COLOR_NAMES: [&str; 5] = ["red", "yellow", "green", "white", "blue"];

fn env(players: usize, history: usize) -> HanabiEnv {
    HanabiEnv::from_params(&serde_json::json!({"players": players, "observation": "compact", "history_moves": history}))
        .unwrap()
}

/// `1?1(RG)` -> (slot, color, rank, plausible colors, plausible ranks) as CardKnowledge holds them.
fn decode_knowledge(text: &str, colors: usize, ranks: usize) -> (usize, CardKnowledge) {
    let chars: Vec<char> = text.chars().collect();
    let slot = chars[0].to_digit(10).unwrap() as usize;
    let color = COLORS.iter().position(|&c| c == chars[1]).map(|c| c as u8);
    let rank = chars[2].to_digit(10).map(|r| (r - 1) as u8);
    let mut k = CardKnowledge::new(colors, ranks);
    if let Some(c) = color {
        k.apply_color(c);
    }
    if let Some(r) = rank {
        k.apply_rank(r);
    }
    if chars.len() > 3 {
        assert_eq!((chars[3], chars[chars.len() - 1]), ('(', ')'), "{text}");
        let inside = &chars[4..chars.len() - 1];
        let listed_colors: Vec<u8> =
            inside.iter().filter_map(|c| COLORS.iter().position(|x| x == c)).map(|c| c as u8).collect();
        let listed_ranks: Vec<u8> = inside.iter().filter_map(|c| c.to_digit(10)).map(|r| (r - 1) as u8).collect();
        assert!(!listed_colors.is_empty() || !listed_ranks.is_empty(), "{text}");
        if !listed_colors.is_empty() {
            k.plausible_colors = listed_colors.iter().fold(0, |m, c| m | 1 << c);
        }
        if !listed_ranks.is_empty() {
            k.plausible_ranks = listed_ranks.iter().fold(0, |m, r| m | 1 << r);
        }
    }
    (slot, k)
}

fn line<'a>(text: &'a str, prefix: &str) -> Option<&'a str> {
    text.lines().find_map(|l| l.strip_prefix(prefix))
}

/// `1-3 5` -> [1, 2, 3, 5]
fn expand(ranges: &str) -> Vec<usize> {
    ranges
        .split(' ')
        .flat_map(|part| match part.split_once('-') {
            Some((a, b)) => (a.parse().unwrap()..=b.parse().unwrap()).collect::<Vec<usize>>(),
            None => vec![part.parse().unwrap()],
        })
        .collect()
}

fn decode_legal(line: &str, state: &HanabiState) -> BTreeSet<u32> {
    let config = state.config();
    let (players, mover) = (config.players, state.current_player());
    let mut moves = BTreeSet::new();
    for group in line.split("; ") {
        let (verb, rest) = group.split_once(' ').unwrap();
        match verb {
            "play" => moves.extend(expand(rest).into_iter().map(|n| Move::Play { index: n - 1 }.uid(config))),
            "discard" => moves.extend(expand(rest).into_iter().map(|n| Move::Discard { index: n - 1 }.uid(config))),
            "hint" => {
                let mut words: Vec<&str> = rest.split(' ').collect();
                let target = if players == 2 {
                    (mover + 1) % 2
                } else {
                    words.remove(0).strip_prefix('P').unwrap().parse::<usize>().unwrap()
                };
                let offset = (target + players - mover) % players;
                for word in words {
                    let mv = match COLOR_NAMES.iter().position(|c| *c == word) {
                        Some(color) => Move::RevealColor { offset, color: color as u8 },
                        None => Move::RevealRank { offset, rank: (word.parse::<u8>().unwrap()) - 1 },
                    };
                    moves.insert(mv.uid(config));
                }
            }
            other => panic!("unknown verb {other} in {line}"),
        }
    }
    moves
}

fn check(env: &HanabiEnv, seat: usize) {
    let state = env.state();
    let config = state.config();
    let (colors, ranks, players) = (config.colors, config.ranks, config.players);
    // Every fact below is one the verbose observation shows of the same state.
    let text = env.observation(seat);

    // Fireworks, score, tokens, deck.
    let counters = line(&text, "Fireworks ").unwrap();
    for (c, &height) in state.fireworks().iter().enumerate() {
        assert!(counters.contains(&format!("{}{height}", COLORS[c])), "{counters}");
    }
    assert!(counters.contains(&format!("(score {}/{})", state.score(), config.max_score())), "{counters}");
    assert!(counters.contains(&format!("Info {}/{}", state.information_tokens(), config.max_information_tokens)));
    assert!(counters.contains(&format!("Lives {}/{}", state.life_tokens(), config.max_life_tokens)));
    assert!(counters.contains(&format!("Deck {}.", state.deck_size())));
    if state.deck_size() == 0 && !state.is_terminal() {
        assert!(counters.contains(&format!("{} turn(s) left", state.turns_to_play())), "{counters}");
    }
    // Discards, as a multiset.
    let discards = line(&text, "Discards: ").unwrap().trim_end_matches('.');
    let mut listed: Vec<String> =
        if discards == "none" { vec![] } else { discards.split(' ').map(String::from).collect() };
    let mut actual: Vec<String> = state.discards().iter().map(|c| c.to_string()).collect();
    listed.sort();
    actual.sort();
    assert_eq!(listed, actual);
    // One's own hand: exactly the hint knowledge, slot by slot.
    let own: Vec<(usize, CardKnowledge)> =
        line(&text, "You: ").unwrap().split(' ').map(|k| decode_knowledge(k, colors, ranks)).collect();
    assert_eq!(own.len(), state.hands()[seat].len());
    for (i, (slot, k)) in own.iter().enumerate() {
        assert_eq!(*slot, i + 1);
        assert_eq!(*k, state.hands()[seat][i].knowledge, "own card {slot} in {text}");
    }
    // The others' hands and what they know.
    for offset in 1..players {
        let other = (seat + offset) % players;
        let cards: Vec<&str> = line(&text, &format!("P{other}: ")).unwrap().split(' ').collect();
        assert_eq!(cards.len(), state.hands()[other].len());
        for (i, held) in state.hands()[other].iter().enumerate() {
            let (card, knows) = cards[i].split_once(':').unwrap_or((cards[i], "??"));
            assert_eq!(card, format!("{}{}", i + 1, held.card));
            assert_eq!(decode_knowledge(&format!("{}{knows}", i + 1), colors, ranks).1, held.knowledge, "{}", cards[i]);
        }
    }
    // The latest moves: as many as configured (or made), each naming its card or touched slots.
    let moves: Vec<&Event> = state.events().iter().filter(|e| matches!(e, Event::Move { .. })).collect();
    let shown = moves.len().min(config.history_moves);
    let recent: Vec<&str> = line(&text, "Recent: ").map(|l| l.split(" | ").collect()).unwrap_or_default();
    assert_eq!(recent.len(), shown, "{text}");
    for (event, entry) in moves[moves.len() - shown..].iter().zip(&recent) {
        let Event::Move { player, card, touched, mv, .. } = event else { unreachable!() };
        let actor = if *player == seat { "you".to_string() } else { format!("P{player}") };
        assert!(entry.starts_with(&actor), "{entry}");
        match mv {
            Move::Play { index } | Move::Discard { index } => {
                assert!(entry.contains(&format!("{} ({})", card.unwrap(), index + 1)), "{entry}");
            }
            _ => {
                let slots: Vec<String> = touched.iter().map(|s| (s + 1).to_string()).collect();
                assert!(entry.ends_with(&format!(": {}", slots.join(","))), "{entry}");
            }
        }
    }
    // Legal moves: the line lists exactly them, and each action text parses back to its move.
    if state.current_player() == seat && !state.is_terminal() {
        let legal = decode_legal(line(&text, "Legal: ").unwrap(), state);
        let actual: BTreeSet<u32> = env.legal_action_ids(seat).unwrap().into_iter().collect();
        assert_eq!(legal, actual, "{text}");
        for action in env.legal_actions(seat).unwrap() {
            assert_eq!(env.parse_action(seat, &action.text).unwrap(), Action::Id(action.id), "{}", action.text);
        }
    } else {
        assert!(line(&text, "Legal: ").is_none());
    }
}

#[test]
fn the_compact_observation_holds_everything_the_verbose_one_holds() {
    let mut states = 0;
    for players in 2..=5 {
        for seed in 0..12u64 {
            let mut env = env(players, 2 * players);
            env.reset(seed);
            let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0xC0FFEE);
            loop {
                for seat in 0..players {
                    check(&env, seat);
                }
                states += 1;
                if env.is_terminal() {
                    break;
                }
                let seat = env.acting_seats()[0];
                let ids = env.legal_action_ids(seat).unwrap();
                // Mostly hints and discards, so that games run long and knowledge builds up.
                let pick = loop {
                    let id = ids[rng.random_range(0..ids.len())];
                    if !matches!(Move::from_uid(id, env.config()), Some(Move::Play { .. })) || rng.random_bool(0.3) {
                        break id;
                    }
                };
                env.step(&[Action::Id(pick)]).unwrap();
            }
        }
    }
    assert!(states > 1000, "{states} states checked");
}

#[test]
fn the_compact_observation_is_far_shorter() {
    let mut compact = env(2, 4);
    let mut verbose = HanabiEnv::from_params(&serde_json::json!({"players": 2, "history_moves": 4})).unwrap();
    for e in [&mut compact, &mut verbose] {
        e.reset(7);
        for _ in 0..6 {
            let seat = e.acting_seats()[0];
            let id = *e.legal_action_ids(seat).unwrap().last().unwrap();
            e.step(&[Action::Id(id)]).unwrap();
        }
    }
    let seat = compact.acting_seats()[0];
    let (c, v) = (
        compact.observation(seat) + &compact.instructions(seat),
        verbose.observation(seat) + &verbose.instructions(seat),
    );
    assert!(c.len() * 3 < v.len(), "compact {} chars vs verbose {}", c.len(), v.len());
}
