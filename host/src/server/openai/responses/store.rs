//! The responses kept for `previous_response_id`, `GET`, `DELETE`,
//! `input_items` and background generation.

use serde_json::Value;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

/// Stored responses per tenant; the oldest go first beyond this.
pub(crate) const STORED_PER_TENANT: usize = 512;

/// One stored response: the response object as the client got it, and
/// the conversation `previous_response_id` continues (the messages it was
/// generated from, then its answer).
pub(crate) struct Stored {
    pub(crate) id: String,
    pub(crate) response: Value,
    pub(crate) conversation: Vec<Value>,
    /// The request's own `input`, as items (`input_items` lists them).
    pub(crate) input_items: Vec<Value>,
}

/// Responses created with `store` (the default): what
/// `previous_response_id`, `GET /v1/responses/{id}` and `DELETE` find.
/// Bounded per tenant (the oldest go first), and a tenant sees only its own.
#[derive(Default)]
pub struct ResponseStore {
    pub(crate) by_tenant: Mutex<HashMap<String, VecDeque<Stored>>>,
    /// Background responses still generating, by (tenant, id): what
    /// cancelling one wakes. Whoever takes an entry out (the generation
    /// finishing, or a cancel) writes the response's final state.
    pub(crate) running: Mutex<HashMap<(String, String), Arc<tokio::sync::Notify>>>,
}

impl ResponseStore {
    pub(crate) fn find<T>(
        &self,
        tenant: &str,
        id: &str,
        f: impl FnOnce(&Stored) -> T,
    ) -> Option<T> {
        let map = self.by_tenant.lock().unwrap_or_else(|e| e.into_inner());
        map.get(tenant)?.iter().find(|s| s.id == id).map(f)
    }

    pub(crate) fn conversation(&self, tenant: &str, id: &str) -> Option<Vec<Value>> {
        self.find(tenant, id, |s| s.conversation.clone())
    }

    /// The response object stored under `id` for `tenant`.
    pub fn response(&self, tenant: &str, id: &str) -> Option<Value> {
        self.find(tenant, id, |s| s.response.clone())
    }

    /// Forgets `id` for `tenant`; whether it was there.
    pub fn delete(&self, tenant: &str, id: &str) -> bool {
        let mut map = self.by_tenant.lock().unwrap_or_else(|e| e.into_inner());
        let Some(list) = map.get_mut(tenant) else {
            return false;
        };
        let before = list.len();
        list.retain(|s| s.id != id);
        list.len() != before
    }

    /// Stores (or replaces) `id`'s response for `tenant`.
    pub(crate) fn put(
        &self,
        tenant: &str,
        id: String,
        response: Value,
        conversation: Vec<Value>,
        input_items: Vec<Value>,
    ) {
        let mut map = self.by_tenant.lock().unwrap_or_else(|e| e.into_inner());
        let list = map.entry(tenant.to_string()).or_default();
        list.retain(|s| s.id != id);
        if list.len() >= STORED_PER_TENANT {
            list.pop_front();
        }
        list.push_back(Stored {
            id,
            response,
            conversation,
            input_items,
        });
    }

    /// Replaces a stored response object, keeping its conversation and
    /// input items (a background response's progress).
    pub(crate) fn set_response(&self, tenant: &str, id: &str, response: Value) {
        let mut map = self.by_tenant.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = map
            .get_mut(tenant)
            .and_then(|l| l.iter_mut().find(|s| s.id == id))
        {
            s.response = response;
        }
    }

    pub(crate) fn input_items(&self, tenant: &str, id: &str) -> Option<Vec<Value>> {
        self.find(tenant, id, |s| s.input_items.clone())
    }

    pub(crate) fn start_background(&self, tenant: &str, id: &str) -> Arc<tokio::sync::Notify> {
        let n = Arc::new(tokio::sync::Notify::new());
        let mut map = self.running.lock().unwrap_or_else(|e| e.into_inner());
        map.insert((tenant.to_string(), id.to_string()), Arc::clone(&n));
        n
    }

    /// Takes `id` out of the running background responses; whether it was
    /// there (the caller then owns its final state).
    pub(crate) fn finish_background(
        &self,
        tenant: &str,
        id: &str,
    ) -> Option<Arc<tokio::sync::Notify>> {
        let mut map = self.running.lock().unwrap_or_else(|e| e.into_inner());
        map.remove(&(tenant.to_string(), id.to_string()))
    }
}
