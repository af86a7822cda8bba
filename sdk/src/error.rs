//! The SDK's error type.

use std::fmt;

/// A plugin error: a message for the host (and, depending on the hook, the
/// client).
///
/// It converts from anything that implements [`Display`](fmt::Display), so
/// `?` works on `String`, `&str`, `serde_json::Error`, template errors and
/// the like. For that blanket conversion to be allowed next to the standard
/// `From<T> for T`, `Error` itself deliberately does not implement
/// `Display`; read the text with [`Error::message`].
pub struct Error {
    message: String,
}

/// `Result` with the SDK's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// An error with this message.
    pub fn msg(message: impl fmt::Display) -> Error {
        Error {
            message: message.to_string(),
        }
    }

    /// The message.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The message, owned.
    pub fn into_message(self) -> String {
        self.message
    }
}

impl<E: fmt::Display> From<E> for Error {
    fn from(e: E) -> Error {
        Error::msg(e)
    }
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Debug shows the bare message so that `unwrap()` failures in tests
        // read naturally.
        f.write_str(&self.message)
    }
}
