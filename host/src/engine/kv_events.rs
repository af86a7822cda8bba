//! Publishing the KV-cache events ([`crate::engine::kv_cache::events`]) as
//! vLLM does, configured by the same `--kv-events-config` JSON: a ZeroMQ PUB
//! socket sends each step's events as a multipart message (topic, an 8-byte
//! big-endian sequence number, the msgpack batch), and an optional ROUTER
//! socket replays buffered batches to a subscriber that missed some.
//!
//! The first batch (sequence 0) is `AllBlocksCleared`: a process starts
//! with an empty cache, and a router that tracked an earlier process at
//! the same endpoint must drop what it knew.
//!
//! Publishing runs on a thread of its own. The engine hands each step's
//! events over a bounded channel without waiting: when the publisher falls
//! behind, the batch is dropped and counted, never the step delayed. A PUB
//! socket drops messages for a subscriber past its high-water mark, as
//! ZeroMQ does, so a slow or absent subscriber costs the engine nothing.

use crate::engine::kv_cache::events::{encode_batch, KvEvent, WireFormat};
use anyhow::{bail, Context, Result};
use serde_json::{Map, Value};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// `--kv-events-config`, with vLLM's keys and defaults.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvEventsConfig {
    /// `publisher`: `zmq`, or `null` (events recorded, sent nowhere).
    pub zmq: bool,
    /// `endpoint`: where the PUB socket binds (a `*` or `::` host) or
    /// connects. Default `tcp://*:5557`.
    pub endpoint: String,
    /// `replay_endpoint`: where the ROUTER socket for replays binds.
    pub replay_endpoint: Option<String>,
    /// `buffer_steps`: batches kept for replay. Default 10000.
    pub buffer_steps: usize,
    /// `hwm`: the PUB socket's high-water mark. Default 100000.
    pub hwm: i32,
    /// `topic`: the first frame of every message. Default empty.
    pub topic: String,
    /// `wire_format` (Pagoda's own key): `"map"` (default), as vLLM 0.32
    /// writes events, or `"array"`, the positional form of earlier vLLM,
    /// for consumers built for it.
    pub wire_format: WireFormat,
}

const KEYS: &[&str] = &[
    "enable_kv_cache_events",
    "publisher",
    "endpoint",
    "replay_endpoint",
    "buffer_steps",
    "hwm",
    "max_queue_size",
    "topic",
    "wire_format",
];

impl KvEventsConfig {
    /// Parses vLLM's `--kv-events-config` JSON. `None` when events are
    /// off (`enable_kv_cache_events` false or absent): a config exists
    /// only for a server that records events.
    pub fn from_json(json: &str) -> Result<Option<KvEventsConfig>> {
        let v: Value = serde_json::from_str(json)
            .with_context(|| format!("--kv-events-config is not valid JSON: {json}"))?;
        let Value::Object(obj) = v else {
            bail!("--kv-events-config must be a JSON object, such as {{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\"}}");
        };
        if let Some(k) = obj.keys().find(|k| !KEYS.contains(&k.as_str())) {
            bail!(
                "--kv-events-config: key \"{k}\" is not supported; the keys read are {}",
                KEYS.join(", ")
            );
        }
        let str_key = |k: &str| -> Result<Option<String>> {
            match obj.get(k) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) => Ok(Some(s.clone())),
                Some(other) => bail!("--kv-events-config: \"{k}\" must be a string, got {other}"),
            }
        };
        let uint_key = |k: &str, obj: &Map<String, Value>| -> Result<Option<u64>> {
            match obj.get(k) {
                None | Some(Value::Null) => Ok(None),
                Some(v) => v.as_u64().map(Some).with_context(|| {
                    format!("--kv-events-config: \"{k}\" must be a non-negative integer, got {v}")
                }),
            }
        };
        let enabled = match obj.get("enable_kv_cache_events") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(other) => bail!(
                "--kv-events-config: \"enable_kv_cache_events\" must be true or false, got {other}"
            ),
        };
        let zmq = match str_key("publisher")?.as_deref() {
            None | Some("zmq") => true,
            Some("null") => false,
            Some(other) => bail!(
                "--kv-events-config: \"publisher\" must be \"zmq\" or \"null\", got \"{other}\""
            ),
        };
        let endpoint = str_key("endpoint")?.unwrap_or_else(|| "tcp://*:5557".into());
        let replay_endpoint = str_key("replay_endpoint")?;
        for (k, e) in [
            ("endpoint", Some(&endpoint)),
            ("replay_endpoint", replay_endpoint.as_ref()),
        ] {
            if let Some(e) = e {
                if !(e.starts_with("tcp://")
                    || e.starts_with("ipc://")
                    || e.starts_with("inproc://"))
                {
                    bail!("--kv-events-config: \"{k}\" {e:?} is not a ZeroMQ endpoint (tcp://HOST:PORT, ipc://PATH)");
                }
            }
        }
        let buffer_steps = uint_key("buffer_steps", &obj)?.unwrap_or(10_000) as usize;
        let hwm = uint_key("hwm", &obj)?.unwrap_or(100_000);
        let hwm = i32::try_from(hwm)
            .with_context(|| format!("--kv-events-config: \"hwm\" {hwm} is too large"))?;
        // vLLM's queue between the scheduler and the publisher thread.
        uint_key("max_queue_size", &obj)?;
        if !enabled {
            return Ok(None);
        }
        Ok(Some(KvEventsConfig {
            zmq,
            endpoint,
            replay_endpoint,
            buffer_steps,
            hwm,
            topic: str_key("topic")?.unwrap_or_default(),
            wire_format: match str_key("wire_format")?.as_deref() {
                None | Some("map") => WireFormat::Map,
                Some("array") => WireFormat::Array,
                Some(other) => bail!(
                    "--kv-events-config: \"wire_format\" must be \"map\" (vLLM 0.32's tagged maps) or \"array\" (earlier vLLM's positional arrays), got \"{other}\""
                ),
            },
        }))
    }
}

/// Steps' events waiting for the publisher thread; beyond this the engine
/// drops batches rather than wait.
const QUEUE_BATCHES: usize = 1024;

/// The engine's end of the publisher.
pub struct KvEventPublisher {
    tx: Option<SyncSender<Vec<KvEvent>>>,
    dropped: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl KvEventPublisher {
    /// Binds (or connects) the sockets `config` names and starts the
    /// publisher thread. Fails, naming the endpoint, when a socket cannot
    /// be set up. With `publisher` `null`, events are taken and discarded.
    pub fn start(config: &KvEventsConfig) -> Result<KvEventPublisher> {
        let (tx, rx) = sync_channel(QUEUE_BATCHES);
        let dropped = Arc::new(AtomicU64::new(0));
        // The cache starts empty: batch 0 tells a router to forget whatever
        // an earlier process at this endpoint had stored (a restarted pod).
        tx.try_send(vec![KvEvent::AllBlocksCleared])
            .context("queueing the first KV-event batch")?;
        let sockets = if config.zmq {
            Some(Sockets::open(config)?)
        } else {
            None
        };
        let buffer_steps = config.buffer_steps;
        let topic = config.topic.clone().into_bytes();
        let format = config.wire_format;
        let thread = std::thread::Builder::new()
            .name("kv-events".into())
            .spawn(move || publish_loop(rx, sockets, topic, buffer_steps, format))
            .context("starting the KV-event publisher thread")?;
        Ok(KvEventPublisher {
            tx: Some(tx),
            dropped,
            thread: Some(thread),
        })
    }

    /// Hands one step's events to the publisher without waiting; counts
    /// the batch as dropped if the publisher is behind.
    pub fn publish(&self, events: Vec<KvEvent>) {
        let Some(tx) = &self.tx else {
            return;
        };
        match tx.try_send(events) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                self.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Batches dropped because the publisher fell behind.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}

impl Drop for KvEventPublisher {
    fn drop(&mut self) {
        // Closing the channel ends the thread once it has sent what is
        // queued.
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The PUB socket, and the ROUTER socket for replays.
struct Sockets {
    _ctx: zmq::Context,
    publish: zmq::Socket,
    replay: Option<zmq::Socket>,
}

impl Sockets {
    fn open(config: &KvEventsConfig) -> Result<Sockets> {
        let ctx = zmq::Context::new();
        let publish = ctx
            .socket(zmq::PUB)
            .context("creating the KV-event PUB socket")?;
        publish
            .set_sndhwm(config.hwm)
            .context("setting the KV-event socket's high-water mark")?;
        publish.set_linger(0)?;
        let e = &config.endpoint;
        // vLLM's rule: a wildcard host (or ipc/inproc) binds; a named host
        // is a proxy to connect to.
        if e.contains('*')
            || e.contains("::")
            || e.starts_with("ipc://")
            || e.starts_with("inproc://")
        {
            publish.bind(e).with_context(|| {
                format!("--kv-events-config: cannot bind the KV-event publisher to {e}")
            })?;
        } else {
            publish.connect(e).with_context(|| {
                format!("--kv-events-config: cannot connect the KV-event publisher to {e}")
            })?;
        }
        let replay = match &config.replay_endpoint {
            None => None,
            Some(r) => {
                let s = ctx
                    .socket(zmq::ROUTER)
                    .context("creating the KV-event replay socket")?;
                s.set_linger(0)?;
                s.bind(r).with_context(|| {
                    format!("--kv-events-config: cannot bind the replay socket to {r}")
                })?;
                Some(s)
            }
        };
        tracing::info!(
            "KV-cache events: publishing on {e}{}",
            config
                .replay_endpoint
                .as_ref()
                .map(|r| format!(", replays on {r}"))
                .unwrap_or_default()
        );
        Ok(Sockets {
            _ctx: ctx,
            publish,
            replay,
        })
    }
}

/// The publisher thread: sends each batch with the next sequence number,
/// keeps the last `buffer_steps` for replay, and answers replay requests
/// between batches.
fn publish_loop(
    rx: Receiver<Vec<KvEvent>>,
    sockets: Option<Sockets>,
    topic: Vec<u8>,
    buffer_steps: usize,
    format: WireFormat,
) {
    let Some(sockets) = sockets else {
        // `publisher: null`: drain and discard.
        while rx.recv().is_ok() {}
        return;
    };
    let mut seq: u64 = 0;
    let mut buffer: VecDeque<(u64, Vec<u8>)> = VecDeque::new();
    loop {
        if let Some(replay) = &sockets.replay {
            serve_replays(replay, &buffer);
        }
        let events = match rx.recv_timeout(Duration::from_millis(50)) {
            Ok(e) => e,
            Err(RecvTimeoutError::Timeout) => continue,
            Err(RecvTimeoutError::Disconnected) => return,
        };
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let payload = match encode_batch(ts, &events, 0, format) {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!("KV-cache events: cannot encode a batch: {e}");
                continue;
            }
        };
        let frames: [&[u8]; 3] = [&topic, &seq.to_be_bytes(), &payload];
        if let Err(e) = sockets.publish.send_multipart(frames, zmq::DONTWAIT) {
            // EAGAIN: no peer can take it now (a connecting PUB); ZeroMQ's
            // own rule for PUB is to drop.
            if e != zmq::Error::EAGAIN {
                tracing::warn!("KV-cache events: sending batch {seq} failed: {e}");
            }
        }
        if buffer_steps > 0 {
            if buffer.len() == buffer_steps {
                buffer.pop_front();
            }
            buffer.push_back((seq, payload));
        }
        seq += 1;
    }
}

/// Answers every waiting replay request: `[identity, "", start_seq]` gets
/// each buffered batch from `start_seq` on as `[identity, "", seq,
/// payload]`, then `[identity, "", -1, ""]`.
fn serve_replays(replay: &zmq::Socket, buffer: &VecDeque<(u64, Vec<u8>)>) {
    while let Ok(frames) = replay.recv_multipart(zmq::DONTWAIT) {
        let [id, _, start] = frames.as_slice() else {
            tracing::warn!(
                "KV-cache events: a replay request of {} frames ignored (expected 3)",
                frames.len()
            );
            continue;
        };
        let Ok(start) = <[u8; 8]>::try_from(start.as_slice()).map(u64::from_be_bytes) else {
            tracing::warn!(
                "KV-cache events: a replay request without an 8-byte sequence number ignored"
            );
            continue;
        };
        for (seq, payload) in buffer.iter().filter(|(s, _)| *s >= start) {
            let frames: [&[u8]; 4] = [id, b"", &seq.to_be_bytes(), payload];
            if replay.send_multipart(frames, 0).is_err() {
                break;
            }
        }
        let end: [&[u8]; 4] = [id, b"", &(-1i64).to_be_bytes(), b""];
        let _ = replay.send_multipart(end, 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_keys_and_defaults() {
        assert_eq!(KvEventsConfig::from_json("{}").unwrap(), None);
        assert_eq!(
            KvEventsConfig::from_json(r#"{"enable_kv_cache_events": false, "publisher": "zmq"}"#)
                .unwrap(),
            None
        );
        let c = KvEventsConfig::from_json(r#"{"enable_kv_cache_events": true}"#)
            .unwrap()
            .unwrap();
        assert!(c.zmq);
        assert_eq!(c.endpoint, "tcp://*:5557");
        assert_eq!(c.replay_endpoint, None);
        assert_eq!((c.buffer_steps, c.hwm), (10_000, 100_000));
        assert_eq!(c.topic, "");
        assert_eq!(
            c.wire_format,
            WireFormat::Map,
            "vLLM 0.32's form by default"
        );
        let c = KvEventsConfig::from_json(
            r#"{"enable_kv_cache_events": true, "wire_format": "array"}"#,
        )
        .unwrap()
        .unwrap();
        assert_eq!(c.wire_format, WireFormat::Array);
        let c = KvEventsConfig::from_json(
            r#"{"enable_kv_cache_events": true, "publisher": "null", "topic": "kv@pod@m", "replay_endpoint": "tcp://*:5558", "buffer_steps": 5}"#,
        )
        .unwrap()
        .unwrap();
        assert!(!c.zmq);
        assert_eq!(c.topic, "kv@pod@m");
        assert_eq!(c.replay_endpoint.as_deref(), Some("tcp://*:5558"));
        assert_eq!(c.buffer_steps, 5);
    }

    #[test]
    fn bad_configurations_say_what_to_change() {
        for (json, says) in [
            (r#"{"enable_kv_cache_events": "yes"}"#, "true or false"),
            (
                r#"{"enable_kv_cache_events": true, "publisher": "kafka"}"#,
                "\"zmq\" or \"null\"",
            ),
            (
                r#"{"enable_kv_cache_events": true, "endpoint": "localhost:5557"}"#,
                "not a ZeroMQ endpoint",
            ),
            (
                r#"{"enable_kv_cache_events": true, "hwm": -1}"#,
                "non-negative integer",
            ),
            (
                r#"{"enable_kv_cache_events": true, "colour": 1}"#,
                "key \"colour\" is not supported",
            ),
            (
                r#"{"enable_kv_cache_events": true, "wire_format": "json"}"#,
                "\"map\" (vLLM 0.32's tagged maps) or \"array\"",
            ),
            (r#"[1]"#, "must be a JSON object"),
            (r#"{"#, "not valid JSON"),
        ] {
            let e = format!("{:#}", KvEventsConfig::from_json(json).unwrap_err());
            assert!(e.contains(says), "{json}: {e}");
        }
    }
}
