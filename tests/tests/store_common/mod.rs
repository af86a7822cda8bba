//! What the state-store tests share: a moto S3 server, a TCP proxy that
//! can take it away, and waiting for a condition.
#![allow(dead_code)]

use pagoda_e2e::{agent, free_port};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The bucket every test creates in its own moto server.
pub const BUCKET: &str = "pagoda-state";

/// A moto S3 server on a free loopback port, killed on drop.
pub struct Moto {
    child: Child,
    pub port: u16,
}

impl Moto {
    pub fn start() -> Moto {
        let port = free_port();
        let child = Command::new("python3")
            .args([
                "-m",
                "moto.server",
                "-H",
                "127.0.0.1",
                "-p",
                &port.to_string(),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("python3 -m moto.server (pip install 'moto[server]')");
        let m = Moto { child, port };
        let t0 = Instant::now();
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "moto did not start; is moto[server] installed?"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        let r = agent()
            .put(&format!("http://127.0.0.1:{port}/{BUCKET}"))
            .send_empty()
            .expect("creating the bucket");
        assert_eq!(r.status().as_u16(), 200);
        m
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A TCP proxy that can be taken down (every connection cut, the port
/// refusing) and brought back on the same port.
pub struct Proxy {
    pub port: u16,
    target: u16,
    up: Arc<AtomicBool>,
    conns: Arc<Mutex<Vec<TcpStream>>>,
    acceptor: Option<std::thread::JoinHandle<()>>,
}

impl Proxy {
    pub fn start(target: u16) -> Proxy {
        let mut p = Proxy {
            port: free_port(),
            target,
            up: Arc::new(AtomicBool::new(false)),
            conns: Arc::new(Mutex::new(Vec::new())),
            acceptor: None,
        };
        p.bring_up();
        p
    }

    pub fn bring_up(&mut self) {
        let l = TcpListener::bind(("127.0.0.1", self.port)).expect("proxy port");
        l.set_nonblocking(true).expect("nonblocking");
        self.up.store(true, Ordering::SeqCst);
        let (up, conns, target) = (Arc::clone(&self.up), Arc::clone(&self.conns), self.target);
        self.acceptor = Some(std::thread::spawn(move || {
            while up.load(Ordering::SeqCst) {
                match l.accept() {
                    Ok((c, _)) => {
                        c.set_nonblocking(false).expect("blocking");
                        let Ok(s) = TcpStream::connect(("127.0.0.1", target)) else {
                            continue;
                        };
                        let mut held = conns.lock().unwrap();
                        held.push(c.try_clone().unwrap());
                        held.push(s.try_clone().unwrap());
                        for (mut a, mut b) in
                            [(c.try_clone().unwrap(), s.try_clone().unwrap()), (s, c)]
                        {
                            std::thread::spawn(move || {
                                let _ = std::io::copy(&mut a, &mut b);
                                let _ = b.shutdown(Shutdown::Write);
                            });
                        }
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        }));
    }

    pub fn take_down(&mut self) {
        self.up.store(false, Ordering::SeqCst);
        if let Some(a) = self.acceptor.take() {
            a.join().unwrap();
        }
        for c in self.conns.lock().unwrap().drain(..) {
            let _ = c.shutdown(Shutdown::Both);
        }
    }
}

/// Waits until `ok` holds; how long it took.
pub fn wait_for(limit: Duration, what: &str, mut ok: impl FnMut() -> bool) -> Duration {
    let t0 = Instant::now();
    while !ok() {
        assert!(t0.elapsed() < limit, "{what}: not after {limit:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
    t0.elapsed()
}
