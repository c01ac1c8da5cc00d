//! How the external protocol's requests reach a server: a child process ([`Process`]), or a
//! server in this process ([`InProcess`], a function answering one request line with one
//! answer line, which is how the Python package runs a Python environment object without a
//! child process). Both check answers the same way.

use serde_json::{Map, Value};

use super::process::{read_answer, request_line, CallError, Process};

/// One end of the protocol's exchange.
pub trait Transport: Send {
    /// One request (`method` with `fields`) and its `result`, or why there is none.
    fn call(&mut self, method: &str, fields: Map<String, Value>) -> Result<Value, CallError>;

    /// Whether an exchange already failed for good (every later call fails).
    fn is_broken(&self) -> bool;

    /// Marks the transport broken and returns the error for `message`.
    fn break_with(&mut self, message: String) -> CallError;
}

impl Transport for Process {
    fn call(&mut self, method: &str, fields: Map<String, Value>) -> Result<Value, CallError> {
        Process::call(self, method, fields)
    }

    fn is_broken(&self) -> bool {
        Process::is_broken(self)
    }

    fn break_with(&mut self, message: String) -> CallError {
        Process::break_with(self, message)
    }
}

/// Answers one request line with one answer line (`Err` when the server cannot answer at all).
pub type LineHandler = Box<dyn FnMut(&str) -> Result<String, String> + Send>;

/// A protocol server in this process, behind a function from request line to answer line.
pub struct InProcess {
    handler: LineHandler,
    next_id: u64,
    broken: Option<String>,
}

impl InProcess {
    /// A transport over `handler`.
    pub fn new(handler: LineHandler) -> Self {
        Self { handler, next_id: 0, broken: None }
    }
}

impl Transport for InProcess {
    fn call(&mut self, method: &str, fields: Map<String, Value>) -> Result<Value, CallError> {
        if let Some(message) = &self.broken {
            return Err(CallError::Broken(message.clone()));
        }
        let id = self.next_id;
        self.next_id += 1;
        let answer = match (self.handler)(&request_line(id, method, fields)) {
            Ok(answer) => answer,
            Err(message) => return Err(self.break_with(format!("could not answer `{method}`: {message}"))),
        };
        read_answer(method, id, &answer).map_err(|err| match err {
            CallError::Broken(message) => self.break_with(message),
            refused => refused,
        })
    }

    fn is_broken(&self) -> bool {
        self.broken.is_some()
    }

    fn break_with(&mut self, message: String) -> CallError {
        self.broken = Some(message.clone());
        CallError::Broken(message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A transport whose server answers with `answer(id)` for every request.
    fn answering(answer: fn(u64) -> String) -> InProcess {
        InProcess::new(Box::new(move |line: &str| {
            let request: Value = serde_json::from_str(line).map_err(|e| e.to_string())?;
            Ok(answer(request["id"].as_u64().unwrap()))
        }))
    }

    #[test]
    fn results_errors_and_broken_answers_are_told_apart() {
        let mut ok = answering(|id| json!({"id": id, "result": {"echo": id}}).to_string());
        assert_eq!(ok.call("reset", Map::new()).unwrap(), json!({"echo": 0}));
        assert_eq!(ok.call("reset", Map::new()).unwrap(), json!({"echo": 1}), "ids count up");

        let mut refusing = answering(|id| json!({"id": id, "error": "no such seat"}).to_string());
        assert!(matches!(refusing.call("parse", Map::new()), Err(CallError::Refused(m)) if m == "no such seat"));
        assert!(!refusing.is_broken(), "a refusal leaves the server usable");

        let mut garbled = answering(|_| "hello".to_string());
        let Err(CallError::Broken(message)) = garbled.call("step", Map::new()) else { panic!("not broken") };
        assert!(message.contains("not a JSON object"), "{message}");
        assert!(garbled.is_broken());
        assert!(matches!(garbled.call("step", Map::new()), Err(CallError::Broken(m)) if m == message), "stays broken");

        let mut failing = InProcess::new(Box::new(|_: &str| Err("TypeError: bad".to_string())));
        let Err(CallError::Broken(message)) = failing.call("init", Map::new()) else { panic!("not broken") };
        assert!(message.contains("could not answer `init`: TypeError: bad"), "{message}");
    }
}
