//! The compact text form of a Hanabi observation, for small models: the same information as
//! [`super::observation`] (fireworks, tokens, deck, discards, one's own cards as hint knowledge,
//! the others' cards and what they know, the latest moves, the legal actions) in a quarter to a sixth
//! of the tokens, with each legal action written together with what the actor knows of it.
//!
//! ```text
//! Hanabi 2p. You are P0. Your turn.
//! Fireworks R0 Y1 G0 W0 B0 (score 1/25). Info 7/8. Lives 3/3. Deck 37.
//! Discards: G4 W2.
//! You: 1?? 2?1 3R? 4??(YGWB1234) 5??
//! P1: 1R1 2Y3 3G2:G? 4B4 5W1
//! Recent: P1 hinted you 1: 2 | you played Y1 (3)
//! Legal: discard 1-5; play 1-5; hint red yellow green blue white; hint 1 2 3 4
//! ```
//!
//! Card knowledge is `<color><rank>`: the hinted color letter or `?`, the hinted rank or `?`,
//! followed by HLE's plausible colors and ranks in brackets when negative hints ruled some out;
//! another player's card is followed by `:` and its holder's knowledge unless they know nothing.
//! The standing instructions are one word (`Hanabi.`): a small model learns the rules from play.
//! A legal action's text carries a note in square brackets that the parser ignores: the actor's
//! knowledge of the card it plays or discards (`play 2 [?1]`), or the cards a hint touches
//! (`hint red [R1 R3]`), so that a model scoring the action sees what it is about.

use std::fmt::Write;

use super::cards::{Card, CardKnowledge, COLOR_CHARS, COLOR_NAMES};
use super::moves::Move;
use super::state::{Event, HanabiState};

/// A card's knowledge in compact form: `R1`, `?1`, `R?`, `??`, then in brackets the colors
/// (letters) and ranks (digits) still plausible where negative hints narrowed an unknown one:
/// `?1(RGW)` is a 1 that is not yellow or blue, `??(YGWB234)` neither red nor 1 nor 5.
pub fn knowledge(k: &CardKnowledge, colors: usize, ranks: usize) -> String {
    let mut out = String::with_capacity(4);
    out.push(k.color.map_or('?', |c| COLOR_CHARS[c as usize]));
    out.push(k.rank.map_or('?', |r| char::from(b'1' + r)));
    let all_colors = (1u8 << colors) - 1;
    let all_ranks = (1u8 << ranks) - 1;
    let colors_narrowed = k.color.is_none() && k.plausible_colors != all_colors;
    let ranks_narrowed = k.rank.is_none() && k.plausible_ranks != all_ranks;
    if colors_narrowed || ranks_narrowed {
        out.push('(');
        if colors_narrowed {
            out.extend((0..colors as u8).filter(|&c| k.color_plausible(c)).map(|c| COLOR_CHARS[c as usize]));
        }
        if ranks_narrowed {
            out.extend((0..ranks as u8).filter(|&r| k.rank_plausible(r)).map(|r| char::from(b'1' + r)));
        }
        out.push(')');
    }
    out
}

/// A player's name as `seat` sees it: `you` or `P<n>`.
fn who(player: usize, seat: usize) -> String {
    if player == seat {
        "you".to_string()
    } else {
        format!("P{player}")
    }
}

/// Cards as `R1 G3`, or `none`.
fn cards(cards: &[Card]) -> String {
    if cards.is_empty() {
        return "none".to_string();
    }
    let mut sorted = cards.to_vec();
    sorted.sort();
    sorted.iter().map(Card::to_string).collect::<Vec<_>>().join(" ")
}

/// One past move, compactly, as `seat` sees it; `None` for deals.
pub fn event(event: &Event, seat: usize, players: usize) -> Option<String> {
    let Event::Move { player, mv, card, scored, touched, .. } = event else {
        return None;
    };
    let actor = who(*player, seat);
    let card = card.map(|c| c.to_string()).unwrap_or_default();
    Some(match *mv {
        Move::Play { index } if *scored => format!("{actor} played {card} ({})", index + 1),
        Move::Play { index } => format!("{actor} misplayed {card} ({}), life lost", index + 1),
        Move::Discard { index } => format!("{actor} discarded {card} ({})", index + 1),
        Move::RevealColor { offset, color: value } | Move::RevealRank { offset, rank: value } => {
            let target = who((player + offset) % players, seat);
            let what = match *mv {
                Move::RevealColor { .. } => COLOR_NAMES[value as usize].to_string(),
                _ => (value + 1).to_string(),
            };
            let slots: Vec<String> = touched.iter().map(|s| (s + 1).to_string()).collect();
            format!("{actor} hinted {target} {what}: {}", slots.join(","))
        }
    })
}

/// Consecutive numbers as ranges: `[1, 2, 3, 5]` -> `1-3 5`.
fn ranges(numbers: &[usize]) -> String {
    let mut parts = Vec::new();
    let mut i = 0;
    while i < numbers.len() {
        let mut j = i;
        while j + 1 < numbers.len() && numbers[j + 1] == numbers[j] + 1 {
            j += 1;
        }
        parts.push(if j > i { format!("{}-{}", numbers[i], numbers[j]) } else { numbers[i].to_string() });
        i = j + 1;
    }
    parts.join(" ")
}

/// The hint target prefix of an action: empty with two players (the other player is implied),
/// else `P<n> `.
fn target_prefix(target: usize, players: usize) -> String {
    if players == 2 {
        String::new()
    } else {
        format!("P{target} ")
    }
}

/// The legal actions of the player to move, grouped: `discard 1-5; play 1-5; hint red blue; hint 1 3`
/// (with `P<n>` before each hint group when there are more than two players).
fn legal_line(state: &HanabiState, legal: &[Move]) -> String {
    let players = state.config().players;
    let mover = state.current_player();
    let slots = |discard: bool| -> Vec<usize> {
        legal
            .iter()
            .filter_map(|m| match *m {
                Move::Discard { index } if discard => Some(index + 1),
                Move::Play { index } if !discard => Some(index + 1),
                _ => None,
            })
            .collect()
    };
    let mut groups = Vec::new();
    for (verb, discard) in [("discard", true), ("play", false)] {
        let s = slots(discard);
        if !s.is_empty() {
            groups.push(format!("{verb} {}", ranges(&s)));
        }
    }
    for offset in 1..players {
        let target = target_prefix((mover + offset) % players, players);
        let colors: Vec<&str> = legal
            .iter()
            .filter_map(|m| match *m {
                Move::RevealColor { offset: o, color } if o == offset => Some(COLOR_NAMES[color as usize]),
                _ => None,
            })
            .collect();
        if !colors.is_empty() {
            groups.push(format!("hint {target}{}", colors.join(" ")));
        }
        let ranks: Vec<String> = legal
            .iter()
            .filter_map(|m| match *m {
                Move::RevealRank { offset: o, rank } if o == offset => Some((rank + 1).to_string()),
                _ => None,
            })
            .collect();
        if !ranks.is_empty() {
            groups.push(format!("hint {target}{}", ranks.join(" ")));
        }
    }
    groups.join("; ")
}

/// The compact observation of `seat` (see the module docs); `history_moves` latest moves.
pub fn observation(state: &HanabiState, seat: usize, history_moves: usize) -> String {
    let config = state.config();
    let (colors, ranks, players) = (config.colors, config.ranks, config.players);
    let mut out = String::new();
    let _ = write!(out, "Hanabi {players}p. You are P{seat}. ");
    if state.is_terminal() {
        let _ = writeln!(out, "Game over, score {}/{}.", state.score(), config.max_score());
    } else if state.current_player() == seat {
        let _ = writeln!(out, "Your turn.");
    } else {
        let _ = writeln!(out, "P{}'s turn.", state.current_player());
    }
    let fireworks: Vec<String> =
        state.fireworks().iter().enumerate().map(|(c, &h)| format!("{}{h}", COLOR_CHARS[c])).collect();
    let _ = write!(
        out,
        "Fireworks {} (score {}/{}). Info {}/{}. Lives {}/{}. Deck {}.",
        fireworks.join(" "),
        state.score(),
        config.max_score(),
        state.information_tokens(),
        config.max_information_tokens,
        state.life_tokens(),
        config.max_life_tokens,
        state.deck_size()
    );
    if state.deck_size() == 0 && !state.is_terminal() {
        let _ = write!(out, " Last round: {} turn(s) left.", state.turns_to_play());
    }
    let _ = writeln!(out, "\nDiscards: {}.", cards(state.discards()));
    let hand = |player: usize, show: &dyn Fn(&super::cards::HandCard) -> String| -> String {
        state.hands()[player]
            .iter()
            .enumerate()
            .map(|(slot, held)| format!("{}{}", slot + 1, show(held)))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let _ = writeln!(out, "You: {}", hand(seat, &|h| knowledge(&h.knowledge, colors, ranks)));
    let unknown = CardKnowledge::new(colors, ranks);
    for offset in 1..players {
        let other = (seat + offset) % players;
        // Each card, then what its holder knows of it when that is anything: `3G3:?3`.
        let shown = |h: &super::cards::HandCard| {
            if h.knowledge == unknown {
                h.card.to_string()
            } else {
                format!("{}:{}", h.card, knowledge(&h.knowledge, colors, ranks))
            }
        };
        let _ = writeln!(out, "P{other}: {}", hand(other, &shown));
    }
    let recent: Vec<String> =
        state.events().iter().rev().filter_map(|e| event(e, seat, players)).take(history_moves).collect();
    if !recent.is_empty() {
        let lines: Vec<&str> = recent.iter().rev().map(String::as_str).collect();
        let _ = writeln!(out, "Recent: {}", lines.join(" | "));
    }
    if state.current_player() == seat && !state.is_terminal() {
        let _ = writeln!(out, "Legal: {}", legal_line(state, &state.legal_moves()));
    }
    out
}

/// The standing instructions in compact form.
pub fn instructions(_state: &HanabiState, _seat: usize) -> String {
    "Hanabi.".to_string()
}

/// Whether every card `k` may still be (by its holder's hints) would be added to the fireworks
/// now: what its holder can deduce is a safe play.
pub fn known_playable(state: &HanabiState, k: &CardKnowledge) -> bool {
    let config = state.config();
    let mut any = false;
    for color in (0..config.colors as u8).filter(|&c| k.color_plausible(c)) {
        for rank in (0..config.ranks as u8).filter(|&r| k.rank_plausible(r)) {
            if !state.playable(Card::new(color, rank)) {
                return false;
            }
            any = true;
        }
    }
    any
}

/// The text of `mv` for the player to move, with its note: `play 2 [?1]`, `discard 4 [R?]`,
/// `hint red [R1 R3]`, `hint P2 3 [G3]` (the target named only with more than two players).
/// With `playable_notes`, a play the actor knows to be safe reads `play 2 [?1 playable]` and a
/// hinted card that is playable now `hint 1 [R1 playable]`: the deductions a person makes at a
/// glance, written out for small models.
pub fn action_text(state: &HanabiState, mv: Move, playable_notes: bool) -> String {
    let config = state.config();
    let (colors, ranks, players) = (config.colors, config.ranks, config.players);
    let mover = state.current_player();
    let own = &state.hands()[mover];
    match mv {
        Move::Play { index } | Move::Discard { index } => {
            let verb = if matches!(mv, Move::Play { .. }) { "play" } else { "discard" };
            let mut note = own.get(index).map(|h| knowledge(&h.knowledge, colors, ranks)).unwrap_or_default();
            let safe = own.get(index).is_some_and(|h| known_playable(state, &h.knowledge));
            if playable_notes && safe && matches!(mv, Move::Play { .. }) {
                note.push_str(" playable");
            }
            format!("{verb} {} [{note}]", index + 1)
        }
        Move::RevealColor { offset, color: value } | Move::RevealRank { offset, rank: value } => {
            let target = (mover + offset) % players;
            let is_color = matches!(mv, Move::RevealColor { .. });
            let touched: Vec<String> = state.hands()[target]
                .iter()
                .filter(|h| if is_color { h.card.color == value } else { h.card.rank == value })
                .map(|h| {
                    if playable_notes && state.playable(h.card) {
                        format!("{} playable", h.card)
                    } else {
                        h.card.to_string()
                    }
                })
                .collect();
            let what = if is_color { COLOR_NAMES[value as usize].to_string() } else { (value + 1).to_string() };
            format!("hint {}{what} [{}]", target_prefix(target, players), touched.join(" "))
        }
    }
}
