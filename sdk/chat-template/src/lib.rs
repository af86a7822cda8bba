//! A [minijinja] environment that renders chat templates the way Hugging
//! Face's `apply_chat_template` does, shared by Pagoda's host and its
//! built-in `chat-template` plugin (a wasm32-wasip2 component) so that a
//! template gives the same prompt in both.
//!
//! HF renders `tokenizer.chat_template` with Jinja2 configured with
//! `trim_blocks=True` and `lstrip_blocks=True` and without auto-escaping, and
//! adds the globals `raise_exception(msg)` and `strftime_now(fmt)` and its own
//! `tojson` filter. [`environment`] sets minijinja up the same way:
//!
//! - `trim_blocks` and `lstrip_blocks` on, no auto-escaping, the trailing
//!   newline of the template dropped;
//! - Python's string, list and dict methods (`.strip()`, `.startswith()`,
//!   `.items()`, `.get()` ...) through `minijinja_contrib::pycompat`;
//! - loop controls (`{% break %}`, `{% continue %}`), macros and
//!   `loop.previtem` / `loop.nextitem`;
//! - `raise_exception(msg)`, which fails rendering; [`render`] hands `msg`
//!   back verbatim as [`RenderError::Raised`], since templates use it to
//!   reject malformed conversations and the client should see their words;
//! - `strftime_now(fmt)`, only if a [`Clock`] is given (a plugin has none;
//!   templates test `strftime_now is defined` and fall back to a fixed date);
//! - `tojson` as HF defines it: Python's `json.dumps(x, ensure_ascii=False,
//!   indent=None, separators=None, sort_keys=False)`, with those arguments
//!   positionally or by keyword, `", "` / `": "` separators and Python's
//!   float formatting (see [`python_float`]).
//!
//! Variables go in as [`Value`]s; [`json_to_value`] converts JSON keeping the
//! key order of every object (as Python dicts do, so `tojson` and `.items()`
//! see a message's fields in the client's order), and [`ordered_map`] builds
//! an insertion-ordered context. Neither relies on minijinja's or
//! serde_json's `preserve_order` features: the order given is the order kept.
//!
//! ```
//! use pagoda_chat_template::{environment, json_to_value, ordered_map, render, Clock};
//!
//! let env = environment(Clock::Fixed(0));
//! let template = env
//!     .template_from_str("{% for m in messages %}\n[{{ m.role }}] {{ m.content.strip() }}\n{% endfor %}")
//!     .unwrap();
//! let messages = serde_json::json!([{"role": "user", "content": " Hi "}]);
//! let ctx = ordered_map([("messages", json_to_value(&messages))]);
//! assert_eq!(render(&template, ctx).unwrap(), "[user] Hi\n");
//! ```

mod json;
mod time;

pub use json::{json_to_value, ordered_map, python_float};
/// The minijinja this crate is built on, for naming its types
/// ([`Environment`], [`Template`], [`Value`], [`Error`]) at a matching version.
pub use minijinja;

use minijinja::value::Value;
use minijinja::{AutoEscape, Environment, Error, ErrorKind, Template};
use std::fmt;

/// Where `strftime_now(fmt)` takes the current time from, if anywhere.
///
/// The time is formatted in UTC (HF's `datetime.now()` is the server's local
/// time; servers usually run in UTC).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Clock {
    /// No clock: `strftime_now` is not defined. For WebAssembly plugins,
    /// which have no clock (and must not import one).
    None,
    /// The system's wall clock (`SystemTime::now()`), read at each call.
    /// Needs the `system-clock` feature (on by default).
    #[cfg(feature = "system-clock")]
    System,
    /// Always this instant, in seconds since the Unix epoch: reproducible
    /// renders and tests.
    Fixed(i64),
}

/// A minijinja environment set up as HF's `apply_chat_template` sets up
/// Jinja2 (see the crate docs), with `strftime_now` reading `clock`.
///
/// The environment holds no templates; compile one with
/// [`Environment::template_from_str`] or `add_template_owned` and render it
/// with [`render`] so that `raise_exception` messages come back verbatim.
pub fn environment(clock: Clock) -> Environment<'static> {
    let mut env = Environment::new();
    let syntax = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .keep_trailing_newline(false)
        .build()
        .expect("the default delimiters are valid");
    env.set_syntax(syntax);
    env.set_auto_escape_callback(|_| AutoEscape::None);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", raise_exception);
    env.add_filter("tojson", json::tojson);
    match clock {
        Clock::None => {}
        #[cfg(feature = "system-clock")]
        Clock::System => env.add_function("strftime_now", |fmt: String| {
            let secs = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
            Value::from(time::strftime_utc(secs, &fmt))
        }),
        Clock::Fixed(secs) => env.add_function("strftime_now", move |fmt: String| {
            Value::from(time::strftime_utc(secs, &fmt))
        }),
    }
    env
}

/// Why [`render`] failed.
#[derive(Debug)]
pub enum RenderError {
    /// The template called `raise_exception(message)`; this is `message`,
    /// verbatim (it is also the whole `Display` of the error).
    Raised(String),
    /// Any other failure: an undefined method, a type error, a value that
    /// `tojson` cannot write ...
    Template(Error),
}

impl fmt::Display for RenderError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RenderError::Raised(message) => f.write_str(message),
            RenderError::Template(e) => fmt::Display::fmt(e, f),
        }
    }
}

impl std::error::Error for RenderError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            RenderError::Raised(_) => None,
            RenderError::Template(e) => Some(e),
        }
    }
}

/// Renders `template` with the variables `ctx` (a map, e.g. from
/// [`ordered_map`]). A `raise_exception(msg)` anywhere in the template (a
/// macro, a recursive loop ...) comes back as [`RenderError::Raised`]`(msg)`,
/// without the error kind and location minijinja adds to its messages.
pub fn render(template: &Template<'_, '_>, ctx: Value) -> Result<String, RenderError> {
    template.render(ctx).map_err(|e| match raised_message(&e) {
        Some(message) => RenderError::Raised(message.to_owned()),
        None => RenderError::Template(e),
    })
}

/// The message of the `raise_exception` call behind `err`, if it was one.
/// minijinja may wrap a function's error (e.g. "error in super block"), so
/// the whole chain of sources is searched.
fn raised_message(err: &Error) -> Option<&str> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = cur {
        if let Some(Raised(message)) = e.downcast_ref::<Raised>() {
            return Some(message);
        }
        cur = e.source();
    }
    None
}

/// The source attached to the error of a `raise_exception` call: marks the
/// error as the template's own and keeps its message as written.
#[derive(Debug)]
struct Raised(String);

impl fmt::Display for Raised {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

/// `raise_exception(msg)`: fails rendering with `msg`.
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message.clone()).with_source(Raised(message)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Renders `source` with the variables of the JSON object `vars`.
    fn render_with(source: &str, vars: serde_json::Value) -> Result<String, RenderError> {
        let env = environment(Clock::None);
        let template = env
            .template_from_str(source)
            .map_err(RenderError::Template)?;
        render(&template, json_to_value(&vars))
    }

    #[test]
    fn python_methods_and_whitespace_control() {
        let env = environment(Clock::None);
        let template = env
            .template_from_str("{% for k, v in d.items() %}\n    {{ k }}={{ v.strip() }}{% if not loop.last %},{% endif %}\n{% endfor %}\n{{ s.startswith('ab') }} {{ s.split('b') }} {{ d.get('a') }}{{ d.get('q', '-') }}")
            .unwrap();
        let d = ordered_map([("z", Value::from(" 1 ")), ("a", Value::from("2"))]);
        let out = render(
            &template,
            ordered_map([("d", d), ("s", Value::from("abc"))]),
        )
        .unwrap();
        // trim_blocks eats the newline after each block tag, as in Jinja;
        // Python's booleans and lists print Python-style; dict order is kept.
        assert_eq!(out, "    z=1,    a=2True ['a', 'c'] 2-");
    }

    #[test]
    fn lstrip_blocks_and_trailing_newline() {
        let src = "{% for m in messages %}\n  {% if m.content.strip().startswith('x') %}\n[{{ m['content'].strip() | upper }}]\n  {% endif %}\n{% endfor %}\n";
        let out = render_with(
            src,
            json!({"messages": [{"role": "user", "content": "  xy "}, {"role": "user", "content": "no"}]}),
        )
        .unwrap();
        assert_eq!(out, "[XY]\n");
    }

    #[test]
    fn loop_controls_and_macros() {
        let out = render_with(
            "{% macro m(x) %}<{{ x }}>{% endmacro %}{% for i in range(5) %}{% if i == 3 %}{% break %}{% endif %}{% if i == 1 %}{% continue %}{% endif %}{{ m(i) }}{{ loop.nextitem }}{% endfor %}",
            json!({}),
        )
        .unwrap();
        assert_eq!(out, "<0>1<2>3");
    }

    #[test]
    fn no_auto_escaping() {
        let out = render_with("{{ s }}", json!({"s": "<b>&\"'"})).unwrap();
        assert_eq!(out, "<b>&\"'");
    }

    #[test]
    fn raise_exception_verbatim() {
        let err = render_with(
            "{% if messages[0].role != 'user' %}{{ raise_exception('Conversation must start with user') }}{% endif %}ok",
            json!({"messages": [{"role": "assistant", "content": "x"}]}),
        )
        .unwrap_err();
        assert!(matches!(&err, RenderError::Raised(m) if m == "Conversation must start with user"));
        assert_eq!(err.to_string(), "Conversation must start with user");
        // From a macro, and from inside a recursive loop.
        let err = render_with(
            "{% macro check(x) %}{% if x > 1 %}{{ raise_exception('too big: ' ~ x) }}{% endif %}{% endmacro %}{% for i in [1, 2] %}{{ check(i) }}{% endfor %}",
            json!({}),
        )
        .unwrap_err();
        assert_eq!(err.to_string(), "too big: 2");
        let err = render_with(
            "{% for n in tree recursive %}{% if n.bad %}{{ raise_exception('bad node') }}{% endif %}{{ loop(n.kids) }}{% endfor %}",
            json!({"tree": [{"kids": [{"kids": [], "bad": true}]}]}),
        )
        .unwrap_err();
        assert_eq!(err.to_string(), "bad node");
    }

    #[test]
    fn other_errors_are_not_raised() {
        let err = render_with("{{ 1 + 'a' }}", json!({})).unwrap_err();
        assert!(matches!(err, RenderError::Template(_)), "{err:?}");
        // A raise in one render does not leak into the next.
        assert!(render_with("{{ raise_exception('x') }}", json!({})).is_err());
        let err = render_with("{{ ''.nope() }}", json!({})).unwrap_err();
        assert!(matches!(err, RenderError::Template(_)), "{err:?}");
    }

    #[test]
    fn strftime_now_follows_the_clock() {
        let src = "{% if strftime_now is defined %}{{ strftime_now('%d %b %Y') }}{% else %}none{% endif %}";
        let render_at = |clock| {
            let env = environment(clock);
            let template = env.template_from_str(src).unwrap();
            render(&template, ordered_map::<&str>([])).unwrap()
        };
        assert_eq!(render_at(Clock::None), "none");
        // 2024-07-26 12:34:56 UTC.
        assert_eq!(render_at(Clock::Fixed(1_721_997_296)), "26 Jul 2024");
        #[cfg(feature = "system-clock")]
        {
            let out = render_at(Clock::System);
            assert_eq!(out.len(), 11, "{out}");
            assert!(out[7..].parse::<u32>().unwrap() >= 2024, "{out}");
        }
    }
}
