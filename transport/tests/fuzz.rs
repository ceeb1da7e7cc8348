//! Fuzz targets of the transfer protocol's byte stream (`backend/proto.rs`, its frames
//! decoded by `backend/codec.rs`), through the public path the bytes take — real loopback
//! sockets (the codec's decoders are also property-tested alone, in `codec.rs`):
//!
//! - `transfer_requests`: what a transfer engine's server loop (`proto::serve`) makes of
//!   whatever a peer sends: each input is written on a fresh TCP connection to an engine
//!   without keys and, alternately, to one that requires them. Checked: nothing panics (a
//!   panic hook counts panics on every thread, the engines' I/O threads included), both
//!   engines still serve a proper session afterwards, and the keyed engine's memory never
//!   changes (no input can prove a key).
//! - `transfer_answers`: what an initiator (`connect`: the greeting, `GET_REGIONS`,
//!   `codec::decode_regions`, `proto::answer_error`) makes of whatever a target answers: a fake
//!   target answers every connection with the input. Checked: nothing panics, and every
//!   session that opens holds descriptors that pass `validate_descriptors`.
//!
//! The decoders run on the engines' threads, so the driver's allocation watch does not see
//! them here (`runtime/tests/fuzz.rs` fuzzes `decode_regions`' archive directly). See
//! `runtime/tests/fuzz_support` and docs/testing.md, "Fuzzing".

#[path = "../../runtime/tests/fuzz_support/mod.rs"]
mod fuzz_support;

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use fuzz_support::{draw, Target, Verdict};
use pdserve_transport::memory::validate_descriptors;
use pdserve_transport::{
    Access, BackendKind, RegionGrant, RegisteredRegion, SessionCredentials, SessionGrant,
    SessionGrantGuard, SessionKey, TransferConfig, TransferEngine, TransferOp,
};
use proptest::collection::vec;
use proptest::prelude::*;

const REGION: usize = 64 << 10;
/// A liveness bound on one exchange (a target that never answers or never closes); a
/// normal exchange takes well under a millisecond.
const EXCHANGE_BOUND: Duration = Duration::from_secs(30);

/// Panics on any thread of this process since it started (the engines' tasks included).
static PANICS: AtomicU64 = AtomicU64::new(0);
static LAST_PANIC: Mutex<String> = Mutex::new(String::new());

fn count_panics() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            // A panic on a test's own thread is the driver's to report (it catches the
            // check's panics and fails with the input): counting it here would blame it on
            // whichever target runs beside it.
            let thread = std::thread::current();
            if matches!(
                thread.name(),
                Some("transfer_requests" | "transfer_answers")
            ) {
                default(info);
                return;
            }
            PANICS.fetch_add(1, Ordering::SeqCst);
            if let Ok(mut last) = LAST_PANIC.lock() {
                *last = format!(
                    "{info} (thread {:?})",
                    std::thread::current().name().unwrap_or("?")
                );
            }
            default(info);
        }));
    });
}

/// Err if a panic happened on any thread since `before` (the input's own panics are caught
/// by the driver too, but an engine task's only show here).
fn no_new_panic(before: u64) -> Result<(), String> {
    let now = PANICS.load(Ordering::SeqCst);
    if now != before {
        let last = LAST_PANIC.lock().map(|l| l.clone()).unwrap_or_default();
        return Err(format!(
            "{} panic(s) while it ran; the last: {last}",
            now - before
        ));
    }
    Ok(())
}

fn config(name: &str) -> TransferConfig {
    let mut c = TransferConfig::new(BackendKind::Tcp, name);
    c.tcp_connections = 1;
    // Liveness bounds only (a loaded machine must not turn a slow connect into a failure).
    c.peer_timeout = EXCHANGE_BOUND;
    c.connect_timeout = EXCHANGE_BOUND;
    c
}

struct Targets {
    rt: tokio::runtime::Runtime,
    open: TransferEngine,
    open_regions: Vec<RegisteredRegion>,
    keyed: TransferEngine,
    keyed_regions: Vec<RegisteredRegion>,
    keyed_before: Vec<Vec<u8>>,
    initiator: TransferEngine,
    local: RegisteredRegion,
}

fn regions(engine: &TransferEngine, byte: u8) -> Vec<RegisteredRegion> {
    (0..2u8)
        .map(|i| {
            let r = engine.allocate_and_register(REGION).expect("register");
            r.write_at(0, &vec![byte ^ i; REGION]).expect("fill");
            r
        })
        .collect()
}

impl Targets {
    fn new() -> Self {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let open = TransferEngine::new(config("open-target")).expect("engine");
        let open_regions = regions(&open, 0x11);
        let mut keyed_cfg = config("keyed-target");
        keyed_cfg.require_auth = true;
        let keyed = TransferEngine::new(keyed_cfg).expect("engine");
        let keyed_regions = regions(&keyed, 0x22);
        let keyed_before = keyed_regions
            .iter()
            .map(|r| r.read_at(0, REGION).expect("read"))
            .collect();
        let initiator = TransferEngine::new(config("initiator")).expect("engine");
        let local = initiator.allocate_and_register(REGION).expect("register");
        Self {
            rt,
            open,
            open_regions,
            keyed,
            keyed_regions,
            keyed_before,
            initiator,
            local,
        }
    }

    /// Grants `key` every region of the keyed engine, for the initiator.
    fn grant(&self, key: SessionKey) -> SessionGrantGuard {
        self.keyed
            .grant_session(SessionGrant {
                key,
                peer: "initiator".into(),
                regions: self
                    .keyed_regions
                    .iter()
                    .map(|r| RegionGrant::whole(r.id(), Access::ReadWrite))
                    .collect(),
            })
            .expect("grant")
    }

    /// Both engines still serve a proper session: a write and a read each.
    fn still_serve(&self) -> Result<(), String> {
        self.rt.block_on(async {
            for (engine, region, creds) in [
                (&self.open, &self.open_regions[1], None),
                (
                    &self.keyed,
                    &self.keyed_regions[1],
                    Some(SessionCredentials {
                        key: SessionKey::generate().expect("key"),
                    }),
                ),
            ] {
                let addr = engine.address();
                // A key serves one session: each check proves a fresh one.
                let _grant = creds.as_ref().map(|c| self.grant(c.key.clone()));
                let session = match creds {
                    None => self.initiator.connect(&addr).await,
                    Some(c) => self.initiator.connect_with(&addr, c).await,
                }
                .map_err(|e| format!("{addr} refuses a proper session now: {e}"))?;
                let ops = [
                    TransferOp::write(self.local.id(), 0, region.id(), 0, 4096),
                    TransferOp::read(self.local.id(), 8192, region.id(), 8192, 4096),
                ];
                session
                    .submit(&ops)
                    .map_err(|e| e.to_string())?
                    .wait(EXCHANGE_BOUND)
                    .await
                    .map_err(|e| format!("{addr} fails a proper batch now: {e}"))?;
            }
            Ok(())
        })
    }
}

/// Writes `input` on a fresh connection to `addr`, closes the sending side, and reads the
/// answers until the target closes. Returns the bytes it answered.
fn exchange(addr: &str, input: &[u8]) -> Result<u64, String> {
    let mut s = TcpStream::connect(addr).map_err(|e| format!("connect {addr}: {e}"))?;
    s.set_read_timeout(Some(EXCHANGE_BOUND)).expect("timeout");
    s.set_write_timeout(Some(EXCHANGE_BOUND)).expect("timeout");
    let mut reader = s.try_clone().expect("clone the socket");
    std::thread::scope(|scope| {
        // Read concurrently: answers (reads of a region) may outgrow the socket buffers.
        let answered = scope.spawn(move || {
            let mut buf = [0u8; 16 << 10];
            let mut total = 0u64;
            loop {
                match reader.read(&mut buf) {
                    Ok(0) => return Ok(total),
                    Ok(n) => total += n as u64,
                    Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return Ok(total),
                    Err(e) => return Err(format!("the target neither answered nor closed: {e}")),
                }
            }
        });
        // The target may close before taking everything: a write error is an answer too.
        let _ = s.write_all(input);
        let _ = s.shutdown(Shutdown::Write);
        answered.join().expect("reader thread")
    })
}

/// A valid HELLO request of a `tcp` initiator, as `proto::hello_payload` builds it.
fn hello() -> Vec<u8> {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let payload = format!("tcp\nmallory\n{}", boot.trim());
    let mut out = header(1, 0, 0, 0, payload.len() as u64, 0).to_vec();
    out.extend(payload.as_bytes());
    out
}

/// A request header: `op, req id, region, offset, len, fence` (48 bytes).
fn header(op: u8, req: u64, region: u64, offset: u64, len: u64, fence: u64) -> [u8; 48] {
    let mut h = [0u8; 48];
    h[0] = op;
    h[8..16].copy_from_slice(&req.to_le_bytes());
    h[16..24].copy_from_slice(&region.to_le_bytes());
    h[24..32].copy_from_slice(&offset.to_le_bytes());
    h[32..40].copy_from_slice(&len.to_le_bytes());
    h[40..48].copy_from_slice(&fence.to_le_bytes());
    h
}

/// A structured stream of requests: a greeting (or not), then ops with plausible or absurd
/// fields; the regions named are the targets' real ids or others.
fn requests(region_ids: Vec<u64>) -> impl Strategy<Value = Vec<u8>> {
    let field = prop_oneof![
        3 => 0u64..70_000,
        1 => any::<u64>(),
        1 => Just(u64::MAX),
        1 => Just(u32::MAX as u64),
    ];
    let region = prop_oneof![proptest::sample::select(region_ids), any::<u64>(),];
    (
        any::<bool>(),
        vec(
            (
                prop_oneof![1u8..=8, any::<u8>()],
                region,
                field.clone(),
                prop_oneof![0u64..8192, field],
                prop_oneof![Just(0u64), any::<u64>()],
                0usize..64,
            ),
            0..6,
        ),
    )
        .prop_map(|(greet, ops)| {
            let mut out = if greet { hello() } else { Vec::new() };
            for (i, (op, region, offset, len, fence, payload)) in ops.into_iter().enumerate() {
                out.extend(header(op, i as u64 + 1, region, offset, len, fence));
                // Payload bytes: as many as declared for small writes, else a few.
                let n = if len <= 8192 { len as usize } else { payload };
                out.extend(std::iter::repeat_n(0x5A, n));
            }
            out
        })
}

#[test]
fn transfer_requests() {
    count_panics();
    let t = Targets::new();
    let (open, keyed) = (t.open.address(), t.keyed.address());
    let ids: Vec<u64> = t
        .open_regions
        .iter()
        .chain(&t.keyed_regions)
        .map(|r| r.id())
        .collect();
    let n = AtomicU64::new(0);
    let report = Target::new("transfer_requests")
        .dictionary(&[&[1], &[2], &[3], &[4], &[5], &[7], b"tcp\n"])
        .run(
            |input| {
                let before = PANICS.load(Ordering::SeqCst);
                let i = n.fetch_add(1, Ordering::Relaxed);
                let addr = if i & 1 == 0 { &open } else { &keyed };
                let answered = exchange(addr, input)?;
                no_new_panic(before)?;
                if i % 5000 == 4999 {
                    t.still_serve()?;
                }
                Ok(if answered > 0 {
                    Verdict::Accepted
                } else {
                    Verdict::Rejected
                })
            },
            |runner| draw(runner, requests(ids.clone())),
        );
    t.still_serve()
        .expect("the engines serve after the fuzzing");
    let after: Vec<Vec<u8>> = t
        .keyed_regions
        .iter()
        .map(|r| r.read_at(0, REGION).expect("read"))
        .collect();
    // `still_serve` writes 4096 bytes of the initiator's region at offset 0 of region 1.
    let mut expected = t.keyed_before.clone();
    expected[1][..4096].copy_from_slice(&t.local.read_at(0, 4096).expect("read"));
    assert!(
        after == expected,
        "an input without a key changed the keyed engine's memory"
    );
    assert!(report.accepted > 0, "nothing was ever answered: {report:?}");
}

/// A fake target: answers every connection with the current input, then reads what the
/// initiator sends until it closes.
struct FakeTarget {
    addr: String,
    answer: Arc<Mutex<Vec<u8>>>,
}

impl FakeTarget {
    fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("address").to_string();
        let answer = Arc::new(Mutex::new(Vec::new()));
        let shared = answer.clone();
        std::thread::Builder::new()
            .name("fake-target".into())
            .spawn(move || {
                for conn in listener.incoming() {
                    let Ok(mut conn) = conn else { continue };
                    let bytes = shared.lock().expect("answer").clone();
                    std::thread::spawn(move || {
                        let _ = conn.set_read_timeout(Some(EXCHANGE_BOUND));
                        let _ = conn.write_all(&bytes);
                        let _ = conn.shutdown(Shutdown::Write);
                        let mut sink = [0u8; 4096];
                        while matches!(conn.read(&mut sink), Ok(n) if n > 0) {}
                    });
                }
            })
            .expect("spawn the fake target");
        Self { addr, answer }
    }
}

/// An answer header: `status, req id, aux, len` (32 bytes).
fn answer_header(status: u8, req: u64, aux: u64, len: u64) -> [u8; 32] {
    let mut h = [0u8; 32];
    h[0] = status;
    h[8..16].copy_from_slice(&req.to_le_bytes());
    h[16..24].copy_from_slice(&aux.to_le_bytes());
    h[24..32].copy_from_slice(&len.to_le_bytes());
    h
}

fn answers() -> impl Strategy<Value = Vec<u8>> {
    (
        vec(any::<u8>(), 16),
        vec(
            (
                prop_oneof![0u8..=8, any::<u8>()],
                prop_oneof![0u64..4, any::<u64>()],
                any::<u64>(),
                prop_oneof![0u64..512, any::<u64>()],
                0usize..512,
            ),
            0..4,
        ),
        vec(
            (
                any::<u64>(),
                1u64..70_000,
                vec((0u64..70_000, 0u64..70_000), 0..3),
            ),
            0..3,
        ),
    )
        .prop_map(|(nonce, extra, regions)| {
            let mut out = answer_header(0, 0, 0, nonce.len() as u64).to_vec();
            out.extend(nonce);
            let descriptors: Vec<pdserve_transport::RegionDescriptor> = regions
                .into_iter()
                .map(|(id, len, chunks)| pdserve_transport::RegionDescriptor {
                    id,
                    len,
                    chunks: chunks
                        .into_iter()
                        .map(|(offset, len)| pdserve_transport::RegionChunk {
                            offset,
                            len,
                            addr: 0,
                            rkey: 0,
                        })
                        .collect(),
                    shm: None,
                })
                .collect();
            let archive = pdserve_runtime::wire::to_archive(&descriptors)
                .expect("encodes")
                .to_vec();
            out.extend(answer_header(1, 1, 0, archive.len() as u64));
            out.extend(archive);
            for (status, req, aux, len, n) in extra {
                out.extend(answer_header(status, req, aux, len));
                out.extend(std::iter::repeat_n(b'x', n.min(len as usize)));
            }
            out
        })
}

#[test]
fn transfer_answers() {
    count_panics();
    let fake = FakeTarget::start();
    let initiator = TransferEngine::new(config("initiator")).expect("engine");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let report = Target::new("transfer_answers").run(
        |input| {
            let before = PANICS.load(Ordering::SeqCst);
            *fake.answer.lock().expect("answer") = input.to_vec();
            let opened = rt.block_on(initiator.connect(&fake.addr));
            no_new_panic(before)?;
            match opened {
                Ok(session) => {
                    let regions = session.remote_regions();
                    validate_descriptors(&regions).map_err(|e| {
                        format!("a session opened with descriptors that do not validate: {e}")
                    })?;
                    Ok(Verdict::Accepted)
                }
                Err(_) => Ok(Verdict::Rejected),
            }
        },
        |runner| draw(runner, answers()),
    );
    assert!(report.accepted > 0, "no session ever opened: {report:?}");
}

/// Records what a real initiator and a real target say to each other (through a relay), and
/// writes the two corpora: the initiator's bytes per connection (`transfer_requests`), the
/// target's (`transfer_answers`), plus hand-made hostile inputs.
#[test]
#[ignore = "rewrites the corpus in the repository; run by hand after a format change"]
fn regenerate_corpus() {
    let t = Targets::new();
    let mut requests: Vec<(String, Vec<u8>)> = Vec::new();
    let mut answers: Vec<(String, Vec<u8>)> = Vec::new();
    let keyed_addr = t.keyed.address();
    let open_addr = t.open.address();
    for (name, target, keyed) in [("open", &open_addr, false), ("keyed", &keyed_addr, true)] {
        let (relay, recorded) = relay(target);
        t.rt.block_on(async {
            let key = SessionKey::generate().expect("key");
            let _grant = keyed.then(|| t.grant(key.clone()));
            let session = if keyed {
                t.initiator
                    .connect_with(&relay, SessionCredentials { key })
                    .await
            } else {
                t.initiator.connect(&relay).await
            }
            .expect("a session through the relay");
            let region = if keyed {
                &t.keyed_regions[0]
            } else {
                &t.open_regions[0]
            };
            session
                .submit(&[
                    TransferOp::write(t.local.id(), 0, region.id(), 4096, 512),
                    TransferOp::read(t.local.id(), 0, region.id(), 0, 256),
                ])
                .expect("submit")
                .wait(EXCHANGE_BOUND)
                .await
                .expect("a batch through the relay");
            session.notify(b"CHECK").await.expect("notify");
        });
        // The session is dropped (its connections closed): wait for the relay to see both
        // directions of every connection end.
        let deadline = std::time::Instant::now() + EXCHANGE_BOUND;
        while recorded.1.load(Ordering::SeqCst)
            < 2 * recorded.0.lock().expect("recorded").len() as u64
        {
            assert!(
                std::time::Instant::now() < deadline,
                "the relay's connections never ended"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        let conns = recorded.0.lock().expect("recorded").clone();
        for (i, (up, down)) in conns.into_iter().enumerate() {
            requests.push((format!("valid-{name}-connection-{i}.bin"), up));
            // The fuzzed initiator has no key: a keyed target's answers are foreign to it, and
            // so are a data connection's (answers to writes and reads, not to GET_REGIONS).
            let kind = if keyed || i > 0 {
                "hostile-replayed"
            } else {
                "valid"
            };
            answers.push((format!("{kind}-{name}-connection-{i}.bin"), down));
        }
    }
    let ids = [t.open_regions[0].id(), t.keyed_regions[0].id()];
    let mut huge_write = hello();
    huge_write.extend(header(3, 1, ids[0], 0, u64::MAX, 0));
    let mut huge_hello = header(1, 0, 0, 0, u32::MAX as u64, 0).to_vec();
    huge_hello.extend(b"tcp\n");
    let mut out_of_bounds = hello();
    out_of_bounds.extend(header(4, 1, ids[0], u64::MAX - 10, 4096, 0));
    let mut unknown = hello();
    unknown.extend(header(0xEE, 1, 0, 0, 0, 0));
    let mut fenced = hello();
    fenced.extend(header(3, 1, ids[0], 0, 16, u64::MAX));
    fenced.extend([0u8; 16]);
    let mut rdma_keys = hello();
    let ask = b"[1,2,18446744073709551615]";
    rdma_keys.extend(header(8, 1, 0, 0, ask.len() as u64, 0));
    rdma_keys.extend(ask);
    let mut auth_short = hello();
    auth_short.extend(header(7, 1, 0, 0, 3, 0));
    auth_short.extend([1, 2, 3]);
    requests.extend([
        ("hostile-write-len-u64-max.bin".into(), huge_write),
        ("hostile-hello-len-u32-max.bin".into(), huge_hello),
        ("hostile-read-offset-wraps.bin".into(), out_of_bounds),
        ("hostile-unknown-op.bin".into(), unknown),
        ("hostile-foreign-fence.bin".into(), fenced),
        ("hostile-rdma-keys-on-tcp.bin".into(), rdma_keys),
        ("hostile-auth-truncated.bin".into(), auth_short),
        ("hostile-non-utf8-hello.bin".into(), {
            let mut h = header(1, 0, 0, 0, 6, 0).to_vec();
            h.extend([0xff, 0xfe, b'\n', 0xc0, 0x80, b'\n']);
            h
        }),
    ]);
    fuzz_support::write_corpus("transfer_requests", &requests);

    let mut nonce = answer_header(0, 0, 0, 16).to_vec();
    nonce.extend([7u8; 16]);
    let with = |mut tail: Vec<u8>| {
        let mut v = nonce.clone();
        v.append(&mut tail);
        v
    };
    answers.extend([
        (
            "hostile-regions-len-u64-max.bin".into(),
            with(answer_header(1, 1, 0, u64::MAX).to_vec()),
        ),
        (
            "hostile-regions-64-mib-then-eof.bin".into(),
            with(answer_header(1, 1, 0, 64 << 20).to_vec()),
        ),
        (
            "hostile-error-len-u64-max.bin".into(),
            with(answer_header(5, 1, 0, u64::MAX).to_vec()),
        ),
        ("hostile-error-text.bin".into(), {
            let text = b"kind\n\xff\xfe not utf-8";
            let mut tail = answer_header(5, 1, 0, text.len() as u64).to_vec();
            tail.extend(text);
            with(tail)
        }),
        (
            "hostile-answer-for-another-request.bin".into(),
            with(answer_header(1, 99, 0, 0).to_vec()),
        ),
        (
            "hostile-unknown-status.bin".into(),
            with(answer_header(0xEE, 1, 0, 0).to_vec()),
        ),
        ("hostile-regions-garbage.bin".into(), {
            let mut tail = answer_header(1, 1, 0, 40).to_vec();
            tail.extend([0xA5; 40]);
            with(tail)
        }),
        ("hostile-short-nonce.bin".into(), {
            let mut v = answer_header(0, 0, 0, 3).to_vec();
            v.extend([1, 2, 3]);
            v
        }),
        ("hostile-truncated-header.bin".into(), nonce[..20].to_vec()),
    ]);
    fuzz_support::write_corpus("transfer_answers", &answers);
}

/// Per connection, the bytes each side sent; and how many directions have ended.
type Recorded = Arc<(Mutex<Vec<(Vec<u8>, Vec<u8>)>>, AtomicU64)>;

/// A relay to `target` that records, per connection, what each side sent.
fn relay(target: &str) -> (String, Recorded) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("address").to_string();
    let recorded: Recorded = Arc::new((Mutex::new(Vec::new()), AtomicU64::new(0)));
    let target = target.to_string();
    let rec = recorded.clone();
    std::thread::spawn(move || {
        for (i, client) in listener.incoming().enumerate() {
            let Ok(client) = client else { continue };
            let server = TcpStream::connect(&target).expect("connect the target");
            rec.0
                .lock()
                .expect("recorded")
                .push((Vec::new(), Vec::new()));
            for (mut from, mut to, up) in [
                (
                    client.try_clone().expect("clone"),
                    server.try_clone().expect("clone"),
                    true,
                ),
                (server, client, false),
            ] {
                let rec = rec.clone();
                std::thread::spawn(move || {
                    let mut buf = [0u8; 16 << 10];
                    while let Ok(n @ 1..) = from.read(&mut buf) {
                        {
                            let mut r = rec.0.lock().expect("recorded");
                            let side = if up { &mut r[i].0 } else { &mut r[i].1 };
                            side.extend_from_slice(&buf[..n]);
                        }
                        if to.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                    let _ = to.shutdown(Shutdown::Write);
                    rec.1.fetch_add(1, Ordering::SeqCst);
                });
            }
        }
    });
    (addr, recorded)
}

/// The `transfer_requests` target found it: an engine whose owner never takes notifications
/// (no pdserve instance does) held every NOTIFY after its queue filled — and with it the
/// sender's connection — forever. A full queue is now answered `busy`, and the connection
/// serves on.
#[test]
fn a_full_notification_queue_answers_busy() {
    let mut cfg = config("never-reads-notifications");
    cfg.queue_depth = 4;
    let target = TransferEngine::new(cfg).expect("engine");
    let region = target.allocate_and_register(REGION).expect("register");
    let initiator = TransferEngine::new(config("initiator")).expect("engine");
    let local = initiator.allocate_and_register(REGION).expect("register");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let session = initiator.connect(&target.address()).await.expect("session");
        for i in 0..4 {
            session
                .notify(b"note")
                .await
                .unwrap_or_else(|e| panic!("notification {i}: {e}"));
        }
        match tokio::time::timeout(EXCHANGE_BOUND, session.notify(b"one too many")).await {
            Ok(Err(pdserve_transport::TransportError::Remote { kind, .. })) if kind == "busy" => {}
            Ok(other) => panic!("a notification past a full queue: {other:?}"),
            Err(_) => panic!("a notification past a full queue was never answered"),
        }
        session
            .submit(&[TransferOp::write(local.id(), 0, region.id(), 0, 4096)])
            .expect("submit")
            .wait(EXCHANGE_BOUND)
            .await
            .expect("the session serves on");
    });
}
