//! Helpers shared by the action parsers: finding an agent's final answer in its reply and
//! normalising text into lowercase word tokens.

/// The part of an agent's reply that holds its answer: the content of the last
/// `<answer>...</answer>` pair (tags in any case) when there is one, else the whole text.
pub fn answer_span(text: &str) -> &str {
    let lower = text.to_ascii_lowercase();
    // `to_ascii_lowercase` keeps byte offsets, so indices found in `lower` are valid in `text`.
    if let Some(open) = lower.rfind("<answer>") {
        let start = open + "<answer>".len();
        let end = lower[start..].find("</answer>").map_or(text.len(), |i| start + i);
        return &text[start..end];
    }
    text
}

/// `text` without its notes: every `[...]` span (an unclosed `[` runs to the end) removed.
pub fn strip_notes(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.contains('[') {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len());
    let mut depth = 0usize;
    for ch in text.chars() {
        match ch {
            '[' => depth += 1,
            ']' if depth > 0 => depth -= 1,
            _ if depth == 0 => out.push(ch),
            _ => {}
        }
    }
    std::borrow::Cow::Owned(out)
}

/// Splits `text` into lowercase tokens of letters or digits; a letter-digit boundary
/// also splits (`card2` -> `card`, `2`), so do `#`, punctuation and spaces.
pub fn tokens(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut current = String::new();
    let mut last_kind = 0u8; // 0 none, 1 letter, 2 digit
    for ch in text.chars() {
        let kind = if ch.is_ascii_digit() {
            2
        } else if ch.is_alphanumeric() {
            1
        } else {
            0
        };
        if (kind == 0 || kind != last_kind) && !current.is_empty() {
            out.push(std::mem::take(&mut current));
        }
        if kind != 0 {
            current.extend(ch.to_lowercase());
        }
        last_kind = kind;
    }
    if !current.is_empty() {
        out.push(current);
    }
    out
}

/// `text` cut to at most 80 characters for an error message.
pub fn shorten(text: &str) -> String {
    let trimmed = text.trim();
    if trimmed.chars().count() <= 80 {
        trimmed.to_string()
    } else {
        let cut: String = trimmed.chars().take(77).collect();
        format!("{cut}...")
    }
}

/// Reads a small number written as digits or as an English word (`one` ... `thirteen`, `ace`
/// excluded).
pub fn number_word(token: &str) -> Option<u32> {
    if let Ok(n) = token.parse::<u32>() {
        return Some(n);
    }
    const WORDS: [&str; 14] = [
        "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
        "thirteen",
    ];
    WORDS.iter().position(|w| *w == token).map(|i| i as u32)
}

/// The two texts of a two-seat text task's joint action (`actions[i]` is seat i's). Refuses a
/// finished episode, a wrong action count, and an action id (`reason` says what the task takes).
pub fn two_texts<'a>(
    actions: &'a [crate::Action],
    terminal: bool,
    reason: &str,
) -> Result<[&'a str; 2], crate::ActionError> {
    use crate::{Action, ActionError};
    if terminal {
        return Err(ActionError::EpisodeOver);
    }
    let [first, second] = actions else {
        return Err(ActionError::WrongActionCount { expected: 2, got: actions.len() });
    };
    let text = |action: &'a Action| match action {
        Action::Text(text) => Ok(text.as_str()),
        Action::Id(_) => Err(ActionError::Illegal { action: action.to_string(), reason: reason.to_string() }),
    };
    Ok([text(first)?, text(second)?])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answer_tag_wins_and_last_one_counts() {
        assert_eq!(answer_span("think <answer>a</answer> more <ANSWER> b </Answer>"), " b ");
        assert_eq!(answer_span("no tags here"), "no tags here");
        assert_eq!(answer_span("<answer>open ended"), "open ended");
    }

    #[test]
    fn tokens_split_letters_digits_and_punctuation() {
        assert_eq!(tokens("Play card#2, NOW!"), vec!["play", "card", "2", "now"]);
        assert_eq!(tokens("p1 3s"), vec!["p", "1", "3", "s"]);
    }

    #[test]
    fn numbers_as_words() {
        assert_eq!(number_word("three"), Some(3));
        assert_eq!(number_word("12"), Some(12));
        assert_eq!(number_word("red"), None);
    }
}
