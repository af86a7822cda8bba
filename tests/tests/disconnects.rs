//! Clients that go away: every admitted request is abortable from the
//! moment it is admitted, so requests whose clients reset the connection,
//! streamed or not, waiting for a busy engine or already running, end
//! promptly instead of running to `max_tokens` for nobody, and the limits
//! that counted them are free again.

use pagoda_e2e::Server;
use serde_json::json;
use std::io::Write;
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

/// Sends a completion on a raw connection and returns the socket.
fn send(s: &Server, stream: bool, i: usize) -> TcpStream {
    let addr = s.base.trim_start_matches("http://").to_string();
    let mut sock = TcpStream::connect(&addr).expect("connect");
    let body = json!({
        "model": "smol", "prompt": format!("Write a long story number {i}:"),
        "max_tokens": 1000, "ignore_eos": true, "stream": stream,
    })
    .to_string();
    write!(
        sock,
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("write");
    sock
}

/// Closes with a TCP reset (SO_LINGER 0), as a crashed client would.
fn reset(sock: TcpStream) {
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: a valid socket and a correctly sized option value.
    let rc = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&linger as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        )
    };
    assert_eq!(rc, 0, "setsockopt SO_LINGER");
    drop(sock);
}

#[test]
fn requests_whose_clients_reset_end_and_free_their_limits() {
    let s = Server::start(&["--max-num-seqs", "4", "--max-pending-requests", "64"]);
    for round in 0..2 {
        let socks: Vec<TcpStream> = (0..40).map(|i| send(&s, i % 2 == 0, i)).collect();
        std::thread::sleep(Duration::from_millis(50));
        for sock in socks {
            reset(sock);
        }
        // 40 requests of 1000 tokens through 4 sequences would take minutes;
        // aborted, they are gone in moments.
        let started = Instant::now();
        loop {
            let busy =
                s.metric("vllm:num_requests_running") + s.metric("vllm:num_requests_waiting");
            if busy == 0.0 {
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "round {round}: {busy} requests still in the engine with no client"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        assert_eq!(s.metric("vllm:kv_cache_usage_perc"), 0.0, "round {round}");
        // The server is free for a new client, within the pending limit
        // that the 40 had counted against.
        let (st, v) = s.post(
            "/v1/completions",
            &json!({"model": "smol", "prompt": "Hi", "max_tokens": 4}),
        );
        assert_eq!(st, 200, "round {round}: {v}");
    }
}
