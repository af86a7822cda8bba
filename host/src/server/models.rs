//! The models one server serves behind its one port: the main model (the
//! `MODEL` argument and the engine flags) and each `--extra-model` (an
//! embedding model or a reranker beside a chat model, say). Every model has
//! its own engine in this process; a request's `model` field picks it.

use crate::engine::async_engine::AsyncEngine;
use crate::engine::EngineArgs;
use std::sync::{Arc, OnceLock};

/// An `--extra-model`: the names it answers to and how its engine is built.
#[derive(Clone, Debug)]
pub struct ExtraModel {
    pub names: Vec<String>,
    pub args: EngineArgs,
}

/// One served model: its names, where it was read from, and its engine
/// once loaded.
pub struct ServedModel {
    /// The names it answers to; the first labels its metrics.
    pub names: Vec<String>,
    /// The model's path, which `/v1/models` reports as `root`, as vLLM does.
    pub root: String,
    pub(crate) engine: OnceLock<AsyncEngine>,
}

impl ServedModel {
    pub fn new(names: Vec<String>, root: String) -> ServedModel {
        ServedModel {
            names,
            root,
            engine: OnceLock::new(),
        }
    }

    /// Its engine, once loaded.
    pub fn engine(&self) -> Option<&AsyncEngine> {
        self.engine.get()
    }

    pub fn answers_to(&self, name: &str) -> bool {
        self.names.iter().any(|n| n == name)
    }
}

/// Every model the server serves, the main one first.
pub struct ServedModels {
    list: Vec<ServedModel>,
    /// Every name of every model, in order (the main model's first).
    all_names: Vec<String>,
}

impl ServedModels {
    /// `main` first, then the extra models in the order given. Two models
    /// may not share a name: a request could not tell them apart.
    pub fn new(main: ServedModel, extra: Vec<ServedModel>) -> anyhow::Result<ServedModels> {
        let list: Vec<ServedModel> = std::iter::once(main).chain(extra).collect();
        let mut all_names: Vec<String> = Vec::new();
        for m in &list {
            for n in &m.names {
                if all_names.contains(n) {
                    anyhow::bail!(
                        "the served model name {n:?} is given to two models; each model (--served-model-name, --extra-model) needs names of its own"
                    );
                }
                all_names.push(n.clone());
            }
        }
        Ok(ServedModels { list, all_names })
    }

    /// The main model (a request that names no model gets it).
    pub fn main(&self) -> &ServedModel {
        &self.list[0]
    }

    /// Every model, the main one first.
    pub fn iter(&self) -> impl Iterator<Item = &ServedModel> {
        self.list.iter()
    }

    /// The model that answers to `name`.
    pub fn find(&self, name: &str) -> Option<&ServedModel> {
        self.list.iter().find(|m| m.answers_to(name))
    }

    /// Whether some model answers to `name`.
    pub fn serves(&self, name: &str) -> bool {
        self.all_names.iter().any(|n| n == name)
    }

    /// Every served name, the main model's first.
    pub fn all_names(&self) -> &[String] {
        &self.all_names
    }

    /// The loaded engines.
    pub fn engines(&self) -> impl Iterator<Item = &AsyncEngine> {
        self.list.iter().filter_map(ServedModel::engine)
    }
}

/// The Prometheus recorder every series goes to, kept so that an extra
/// model's engine can record through it under its own `model_name`.
static PROMETHEUS: OnceLock<&'static metrics_exporter_prometheus::PrometheusRecorder> =
    OnceLock::new();

/// Installs `recorder` as the process's metrics recorder and keeps it for
/// [`labeled_recorder`].
pub(crate) fn install_recorder(
    recorder: metrics_exporter_prometheus::PrometheusRecorder,
) -> anyhow::Result<()> {
    // It lives as long as the process, as a global recorder does anyway.
    let leaked: &'static metrics_exporter_prometheus::PrometheusRecorder =
        Box::leak(Box::new(recorder));
    if metrics::set_global_recorder(leaked).is_err() {
        anyhow::bail!("cannot install the metrics recorder: one is installed already");
    }
    let _ = PROMETHEUS.set(leaked);
    Ok(())
}

/// A recorder that gives every series recorded through it the label
/// `model_name = name`, which overrides the server-wide `model_name` (the
/// main model's) that the Prometheus exporter adds: an extra model's
/// engine reports under its own name, as a separate vLLM server would.
/// None until [`install_recorder`] ran.
pub(crate) fn labeled_recorder(name: &str) -> Option<Arc<dyn metrics::Recorder + Send + Sync>> {
    let inner = *PROMETHEUS.get()?;
    Some(Arc::new(ModelLabeled {
        inner,
        label: metrics::Label::new("model_name", name.to_string()),
    }))
}

struct ModelLabeled {
    inner: &'static metrics_exporter_prometheus::PrometheusRecorder,
    label: metrics::Label,
}

impl ModelLabeled {
    fn key(&self, key: &metrics::Key) -> metrics::Key {
        key.with_extra_labels(vec![self.label.clone()])
    }
}

impl metrics::Recorder for ModelLabeled {
    fn describe_counter(
        &self,
        key: metrics::KeyName,
        unit: Option<metrics::Unit>,
        description: metrics::SharedString,
    ) {
        self.inner.describe_counter(key, unit, description)
    }

    fn describe_gauge(
        &self,
        key: metrics::KeyName,
        unit: Option<metrics::Unit>,
        description: metrics::SharedString,
    ) {
        self.inner.describe_gauge(key, unit, description)
    }

    fn describe_histogram(
        &self,
        key: metrics::KeyName,
        unit: Option<metrics::Unit>,
        description: metrics::SharedString,
    ) {
        self.inner.describe_histogram(key, unit, description)
    }

    fn register_counter(&self, key: &metrics::Key, m: &metrics::Metadata<'_>) -> metrics::Counter {
        self.inner.register_counter(&self.key(key), m)
    }

    fn register_gauge(&self, key: &metrics::Key, m: &metrics::Metadata<'_>) -> metrics::Gauge {
        self.inner.register_gauge(&self.key(key), m)
    }

    fn register_histogram(
        &self,
        key: &metrics::Key,
        m: &metrics::Metadata<'_>,
    ) -> metrics::Histogram {
        self.inner.register_histogram(&self.key(key), m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(names: &[&str]) -> ServedModel {
        ServedModel::new(names.iter().map(|s| s.to_string()).collect(), "/m".into())
    }

    #[test]
    fn names_resolve_to_their_model_and_may_not_repeat() {
        let m = ServedModels::new(model(&["chat", "alias"]), vec![model(&["embed"])])
            .expect("distinct names");
        assert_eq!(m.all_names(), ["chat", "alias", "embed"]);
        assert_eq!(m.find("alias").map(|s| s.names[0].as_str()), Some("chat"));
        assert_eq!(m.find("embed").map(|s| s.names[0].as_str()), Some("embed"));
        assert!(m.find("other").is_none());
        assert_eq!(m.main().names[0], "chat");
        let e = ServedModels::new(model(&["chat"]), vec![model(&["e", "chat"])])
            .err()
            .expect("a name given twice");
        assert!(
            e.to_string().contains("\"chat\" is given to two models"),
            "{e}"
        );
    }
}
