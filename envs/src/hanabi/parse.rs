//! Reading what a language model writes as a Hanabi move: `play card 2`, `I will discard my 1st
//! card`, `<answer>hint player 1 red</answer>`, `tell player 2 about their 3s`, ...
//!
//! Card numbers are 1-based (card 1 is the oldest, leftmost card) and players are named by their
//! absolute seat number (or, as HLE writes it, by offset from the mover: `player +1`); in a
//! 2-player game a hint may leave the player out. When a reply names
//! several moves, the last one counts (models tend to reason first and answer last).

use super::cards::{COLOR_CHARS, COLOR_NAMES};
use super::moves::Move;
use crate::environment::ActionError;
use crate::text::{answer_span, number_word, shorten, tokens};

/// What kind of move a verb asks for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Verb {
    Play,
    Discard,
    Hint,
}

fn verb(token: &str) -> Option<Verb> {
    match token {
        "play" | "plays" | "playing" => Some(Verb::Play),
        "discard" | "discards" | "discarding" | "drop" | "throw" | "toss" => Some(Verb::Discard),
        "hint" | "hints" | "hinting" | "clue" | "clues" | "reveal" | "reveals" | "tell" | "tells" | "give"
        | "inform" => Some(Verb::Hint),
        _ => None,
    }
}

/// Stands for "the newest card", whatever the hand's length.
const NEWEST: u32 = u32::MAX;

fn ordinal(token: &str) -> Option<u32> {
    match token {
        "first" | "oldest" | "leftmost" => Some(1),
        "newest" | "last" | "latest" | "rightmost" => Some(NEWEST),
        "second" | "2nd" => Some(2),
        "third" | "3rd" => Some(3),
        "fourth" | "4th" => Some(4),
        "fifth" | "5th" => Some(5),
        "sixth" => Some(6),
        "seventh" => Some(7),
        "eighth" => Some(8),
        _ => None,
    }
}

fn color_word(token: &str, colors: usize) -> Option<u8> {
    let singular = token.strip_suffix('s').unwrap_or(token);
    COLOR_NAMES[..colors].iter().position(|name| *name == token || *name == singular).map(|i| i as u8)
}

fn color_letter(token: &str, colors: usize) -> Option<u8> {
    let mut chars = token.chars();
    let (Some(c), None) = (chars.next(), chars.next()) else {
        return None;
    };
    COLOR_CHARS[..colors].iter().position(|l| l.to_ascii_lowercase() == c).map(|i| i as u8)
}

fn rank_word(token: &str) -> Option<u32> {
    match token {
        "ones" => Some(1),
        "twos" => Some(2),
        "threes" => Some(3),
        "fours" => Some(4),
        "fives" => Some(5),
        _ => number_word(token),
    }
}

/// Who a hint is for: a seat number, or HLE's offset from the mover (`player +1`).
#[derive(Debug, PartialEq, Eq, Clone, Copy)]
enum Target {
    Seat(u32),
    Offset(u32),
}

/// The syntax of one move, before it is checked against the rules.
#[derive(Debug, PartialEq, Eq)]
enum Parsed {
    Card { verb_is_play: bool, number: u32 },
    Hint { player: Option<Target>, color: Option<u8>, rank: Option<u32> },
}

/// Parses the words after a verb at `start` up to `end`.
fn parse_after(verb: Verb, words: &[String], colors: usize) -> Result<Parsed, String> {
    match verb {
        Verb::Play | Verb::Discard => {
            for word in words {
                if let Some(n) = ordinal(word).or_else(|| number_word(word)) {
                    return Ok(Parsed::Card { verb_is_play: verb == Verb::Play, number: n });
                }
            }
            Err(format!("`{}` needs a card number", if verb == Verb::Play { "play" } else { "discard" }))
        }
        Verb::Hint => {
            let (mut player, mut color, mut rank) = (None, None, None);
            let mut i = 0;
            while i < words.len() {
                let word = words[i].as_str();
                let next = words.get(i + 1).map(String::as_str);
                match word {
                    "player" | "p" | "seat" | "teammate" | "partner" => {
                        if next == Some("offset") {
                            if let Some(n) = words.get(i + 2).and_then(|t| number_word(t)) {
                                player = Some(Target::Offset(n));
                                i += 2;
                            }
                        } else if let Some(n) = next.and_then(number_word) {
                            player = Some(Target::Seat(n));
                            i += 1;
                        }
                    }
                    "rank" | "number" | "value" | "ranks" | "numbers" => {
                        if let Some(n) = next.and_then(rank_word) {
                            rank = Some(n);
                            i += 1;
                        }
                    }
                    // "cards 2 and 3 are red": the numbers are positions, not a rank.
                    "card" | "cards" | "slot" | "slots" | "position" | "positions" => {
                        while let Some(next) = words.get(i + 1) {
                            if number_word(next).is_some() || ordinal(next).is_some() || next == "and" || next == "or" {
                                i += 1;
                            } else {
                                break;
                            }
                        }
                    }
                    "color" | "colour" => {
                        if let Some(c) = next.and_then(|t| color_word(t, colors).or_else(|| color_letter(t, colors))) {
                            color = Some(c);
                            i += 1;
                        }
                    }
                    _ => {
                        if let Some(c) = color_word(word, colors) {
                            color = Some(c);
                        } else if let Some(n) = rank_word(word) {
                            rank = Some(n);
                        }
                    }
                }
                i += 1;
            }
            if color.is_none() && rank.is_none() {
                return Err("a hint needs a color (e.g. `hint player 1 red`) or a rank (`hint player 1 rank 3`)".into());
            }
            if color.is_some() && rank.is_some() {
                return Err("a hint names either a color or a rank, not both".into());
            }
            Ok(Parsed::Hint { player, color, rank })
        }
    }
}

/// Finds the last move a reply names. Errors say why nothing could be read.
fn parse_syntax(text: &str, colors: usize) -> Result<Parsed, String> {
    // HLE writes hint targets relative to the mover, `player +1`; keep the `+` as a word.
    let words = tokens(&answer_span(text).replace('+', " offset "));
    let verbs: Vec<(usize, Verb)> = words.iter().enumerate().filter_map(|(i, w)| verb(w).map(|v| (i, v))).collect();
    if verbs.is_empty() {
        return Err("expected `play card N`, `discard card N` or `hint player P <color or rank>`".to_string());
    }
    // Runs of hint verbs ("give player 2 a hint about fives") read as one hint.
    let mut groups: Vec<(usize, Verb)> = Vec::new();
    for &(at, verb) in &verbs {
        match groups.last() {
            Some(&(_, Verb::Hint)) if verb == Verb::Hint => {}
            _ => groups.push((at, verb)),
        }
    }
    let mut last_error = String::new();
    for (k, &(start, verb)) in groups.iter().enumerate().rev() {
        let end = groups.get(k + 1).map_or(words.len(), |&(next, _)| next).min(start + 12);
        match parse_after(verb, &words[start + 1..end], colors) {
            Ok(parsed) => return Ok(parsed),
            Err(e) if last_error.is_empty() => last_error = e,
            Err(_) => {}
        }
    }
    Err(last_error)
}

/// Reads `text` as a move of `mover` in a game of `players` players with `hand_len` cards in the
/// mover's hand, `colors` colors and `ranks` ranks. Checks the numbers are in range but not the
/// rules of the moment (tokens, hand contents): [`super::state::HanabiState::illegal_reason`]
/// does that.
pub fn parse_move(
    text: &str,
    mover: usize,
    players: usize,
    hand_len: usize,
    colors: usize,
    ranks: usize,
) -> Result<Move, ActionError> {
    let fail = |reason: String| ActionError::Unparseable { text: shorten(text), reason };
    match parse_syntax(text, colors).map_err(fail)? {
        Parsed::Card { verb_is_play, number } => {
            let number = if number == NEWEST { hand_len as u32 } else { number };
            if number == 0 || number as usize > hand_len {
                return Err(fail(format!("card numbers run from 1 to {hand_len}, got {number}")));
            }
            let index = number as usize - 1;
            Ok(if verb_is_play { Move::Play { index } } else { Move::Discard { index } })
        }
        Parsed::Hint { player, color, rank } => {
            let target = match player {
                Some(Target::Seat(p)) => p as usize,
                Some(Target::Offset(k)) if k >= 1 && (k as usize) < players => (mover + k as usize) % players,
                Some(Target::Offset(k)) => {
                    return Err(fail(format!("player +{k}: offsets run from +1 to +{}", players - 1)));
                }
                None if players == 2 => (mover + 1) % 2,
                None => return Err(fail(format!("say which player gets the hint (0 to {})", players - 1))),
            };
            if target >= players {
                return Err(fail(format!("players are numbered 0 to {}, got {target}", players - 1)));
            }
            if target == mover {
                return Err(fail(format!("you are player {mover}: hints go to other players")));
            }
            let offset = (target + players - mover) % players;
            if let Some(color) = color {
                return Ok(Move::RevealColor { offset, color });
            }
            let rank = rank.unwrap_or(0);
            if rank == 0 || rank as usize > ranks {
                return Err(fail(format!("ranks run from 1 to {ranks}, got {rank}")));
            }
            Ok(Move::RevealRank { offset, rank: (rank - 1) as u8 })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Move, ActionError> {
        parse_move(text, 0, 3, 5, 5, 5)
    }

    #[test]
    fn what_models_write() {
        assert_eq!(parse("I will play card 2"), Ok(Move::Play { index: 1 }));
        assert_eq!(parse("PLAY   CARD   #3."), Ok(Move::Play { index: 2 }));
        assert_eq!(parse("Let me discard my first card"), Ok(Move::Discard { index: 0 }));
        assert_eq!(parse("discard card5"), Ok(Move::Discard { index: 4 }));
        assert_eq!(parse("<answer>hint player 1 red</answer>"), Ok(Move::RevealColor { offset: 1, color: 0 }));
        assert_eq!(parse("Hint Player 2: Blue"), Ok(Move::RevealColor { offset: 2, color: 4 }));
        assert_eq!(parse("hint player 2 rank 3"), Ok(Move::RevealRank { offset: 2, rank: 2 }));
        assert_eq!(parse("tell player 1 about their 3s"), Ok(Move::RevealRank { offset: 1, rank: 2 }));
        assert_eq!(parse("give player 2 a hint about fives"), Ok(Move::RevealRank { offset: 2, rank: 4 }));
        assert_eq!(parse("hint player 1 color w"), Ok(Move::RevealColor { offset: 1, color: 3 }));
        assert_eq!(
            parse_move("(Reveal player +2 color R)", 1, 3, 5, 5, 5),
            Ok(Move::RevealColor { offset: 2, color: 0 })
        );
        assert_eq!(parse_move("hint player +1 rank 2", 2, 3, 5, 5, 5), Ok(Move::RevealRank { offset: 1, rank: 1 }));
        assert!(parse("hint player +3 red").unwrap_err().to_string().contains("offsets run from +1 to +2"));
        assert_eq!(parse("play my newest card"), Ok(Move::Play { index: 4 }));
        assert_eq!(parse("discard the last card"), Ok(Move::Discard { index: 4 }));
        assert_eq!(parse("hint player 1 that cards 2 and 3 are red"), Ok(Move::RevealColor { offset: 1, color: 0 }));
        assert_eq!(parse("tell player 2 that card 4 is a 5"), Ok(Move::RevealRank { offset: 2, rank: 4 }));
    }

    #[test]
    fn answer_tag_and_last_move_win() {
        let text = "I could play card 1, but <answer>discard card 4</answer>";
        assert_eq!(parse(text), Ok(Move::Discard { index: 3 }));
        assert_eq!(parse("Playing is risky, so I discard card 2"), Ok(Move::Discard { index: 1 }));
    }

    #[test]
    fn two_players_may_omit_the_target() {
        assert_eq!(parse_move("hint red", 1, 2, 5, 5, 5), Ok(Move::RevealColor { offset: 1, color: 0 }));
    }

    #[test]
    fn garbage_gets_a_reason() {
        for (text, reason) in [
            ("banana", "expected `play card N`"),
            ("play", "needs a card number"),
            ("play card 7", "card numbers run from 1 to 5"),
            ("hint player 1", "needs a color"),
            ("hint player 1 red 3", "either a color or a rank"),
            ("hint player 0 red", "hints go to other players"),
            ("hint player 5 red", "players are numbered 0 to 2"),
            ("hint red", "say which player"),
            ("hint player 1 rank 9", "ranks run from 1 to 5"),
            ("hint player 1 purple", "needs a color"),
        ] {
            let err = parse(text).unwrap_err();
            assert!(err.to_string().contains(reason), "{text:?}: {err}");
        }
    }
}
