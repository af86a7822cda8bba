//! The plugin value of the running instance: created by the first hook
//! call ([`crate::glue`]), dropped between requests of native tests
//! ([`crate::testing::new_request`]). Apart from both so that neither
//! imports the other.

use crate::Plugin;
use std::any::Any;
use std::cell::RefCell;

thread_local! {
    // The plugin value of this instance. The host makes one instance per
    // request and wasm32 components are single-threaded, so this is
    // per-request state. `Any` because a `static` inside a generic function
    // would not be per type; a component exports exactly one plugin type.
    static INSTANCE: RefCell<Option<Box<dyn Any>>> = const { RefCell::new(None) };
}

/// Runs `f` on this instance's plugin value, creating it on first use.
pub(crate) fn with_instance<P: Plugin, R>(f: impl FnOnce(&mut P) -> R) -> R {
    INSTANCE.with(|cell| {
        let mut slot = cell.borrow_mut();
        if !slot.as_ref().is_some_and(|b| b.is::<P>()) {
            *slot = Some(Box::new(P::default()));
        }
        let plugin = slot
            .as_mut()
            .and_then(|b| b.downcast_mut::<P>())
            .expect("plugin instance was just created");
        f(plugin)
    })
}

/// Drops this thread's plugin value, so the next hook starts a new request.
#[cfg(not(target_arch = "wasm32"))]
pub(crate) fn reset_instance() {
    INSTANCE.with(|cell| *cell.borrow_mut() = None);
}
