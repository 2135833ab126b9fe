//! Several processes training as one (exec/parallel.rs `DataParallel::launched`): who
//! this process is, read from the environment the usual launchers set, and a small TCP
//! rendezvous through which the first process hands NCCL's unique id to the others and
//! which then carries nothing but failures.
//!
//! Launchers: torchrun (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
//! `MASTER_PORT`), Slurm's srun (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`) and
//! Open MPI's mpirun (`OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`,
//! `OMPI_COMM_WORLD_LOCAL_RANK`); the address of process 0 is `MASTER_ADDR` and
//! `MASTER_PORT` in every case (Slurm and MPI scripts export them as for torchrun).
//! torchrun's own agent may already listen on `MASTER_PORT` (its store): graphrun's
//! rendezvous then listens on the port after it. `GRAPHRUN_RENDEZVOUS_PORT` overrides
//! both.
//!
//! Failure: each process keeps its connection to process 0 open for the whole run. A
//! process that fails sends its error (or just closes the connection, when it dies; one
//! that ends cleanly sends "done");
//! process 0 passes the first error on to every other process and closes. Each process
//! watches its connection on a thread and, when it breaks, calls the abort it was given
//! (which aborts its NCCL communicators, so that nothing waits for a peer that is gone).

use crate::error::Result;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// This process's place in a multi-process run.
#[derive(Clone, Debug, PartialEq)]
pub struct Launch {
    /// This process's rank, from 0.
    pub rank: usize,
    /// The number of processes.
    pub world: usize,
    /// Its rank among the processes of its machine (which GPUs it takes).
    pub local_rank: usize,
    /// Process 0's host.
    pub addr: String,
    /// The rendezvous port on process 0's host.
    pub port: u16,
}

/// The first of `names` that `var` has, and its value.
fn first<'a>(
    var: &impl Fn(&str) -> Option<String>,
    names: &[&'a str],
) -> Option<(&'a str, String)> {
    names.iter().find_map(|n| var(n).map(|v| (*n, v)))
}

impl Launch {
    /// This process's place as the launcher's environment says, or `None` when no
    /// launcher set one (or a world of one process). An error names a variable that is
    /// set but wrong, or a missing one the others need.
    pub fn from_env() -> Result<Option<Launch>> {
        Self::from_vars(|n| std::env::var(n).ok())
    }

    /// `from_env` over any source of variables (tests).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Option<Launch>> {
        let first = |names: &[&'static str]| first(&var, names);
        let Some((wname, world)) = first(&["WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"])
        else {
            return Ok(None);
        };
        let num = |name: &str, v: &str| -> Result<usize> {
            v.trim()
                .parse::<usize>()
                .map_err(|_| crate::err!(Input, "{name}={v:?} is not a process count or rank"))
        };
        let world = num(wname, &world)?;
        if world <= 1 {
            return Ok(None);
        }
        let Some((rname, rank)) = first(&["RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"]) else {
            crate::bail!(
                Input,
                "{wname}={world} but no rank is set (RANK, SLURM_PROCID or OMPI_COMM_WORLD_RANK)"
            );
        };
        let rank = num(rname, &rank)?;
        if rank >= world {
            crate::bail!(Input, "{rname}={rank} is not below {wname}={world}");
        }
        let local_rank = match first(&["LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK"])
        {
            Some((n, v)) => num(n, &v)?,
            None => rank,
        };
        let Some(addr) = var("MASTER_ADDR") else {
            crate::bail!(
                Input,
                "{wname}={world}: MASTER_ADDR (the host of process 0) is not set"
            );
        };
        let Some(port) = var("MASTER_PORT") else {
            crate::bail!(
                Input,
                "{wname}={world}: MASTER_PORT (the rendezvous port on process 0's host) is not set"
            );
        };
        let bad_port = |n: &str, v: &str| crate::err!(Input, "{n}={v:?} is not a port number");
        let mut port: u16 = port
            .trim()
            .parse()
            .map_err(|_| bad_port("MASTER_PORT", &port))?;
        // torchrun's agent keeps its own store on MASTER_PORT.
        if var("TORCHELASTIC_USE_AGENT_STORE").is_some_and(|v| v.eq_ignore_ascii_case("true")) {
            port = port
                .checked_add(1)
                .ok_or_else(|| bad_port("MASTER_PORT", "65535"))?;
        }
        if let Some(p) = var("GRAPHRUN_RENDEZVOUS_PORT") {
            port = p
                .trim()
                .parse()
                .map_err(|_| bad_port("GRAPHRUN_RENDEZVOUS_PORT", &p))?;
        }
        Ok(Some(Launch {
            rank,
            world,
            local_rank,
            addr,
            port,
        }))
    }
}

const MAGIC: &[u8; 8] = b"graphrn1";

/// The open connections of a run (see the module comment).
pub struct Link {
    rank: usize,
    /// Process 0: one stream per other process (by rank, None for itself); others: the
    /// stream to process 0 alone.
    streams: Arc<Mutex<Vec<Option<TcpStream>>>>,
    /// The first failure heard, as a message.
    failure: Arc<Mutex<Option<String>>>,
    /// `finish` was called: the connections close as a clean end.
    finished: std::sync::atomic::AtomicBool,
}

impl Link {
    /// The rendezvous: process 0 listens, takes every other process's hello (its rank
    /// and the world it was told), and sends each `payload()` (made after all are
    /// there); the others connect (retrying while process 0 is not up yet) and receive
    /// it. Everything must happen within `timeout`.
    pub fn join(
        l: &Launch,
        timeout: Duration,
        payload: impl FnOnce() -> Result<Vec<u8>>,
    ) -> Result<(Vec<u8>, Link)> {
        let deadline = Instant::now() + timeout;
        let io = |what: &str, e: std::io::Error| {
            crate::err!(Runtime, "rendezvous of {} processes: {what}: {e}", l.world)
        };
        let mut streams: Vec<Option<TcpStream>> = (0..l.world).map(|_| None).collect();
        let data;
        if l.rank == 0 {
            // A peer's connection that met itself holds the port until it drops it (the
            // peers' loop below): retry a taken port for a moment.
            let give_up = Instant::now() + Duration::from_secs(2);
            let listener = loop {
                match TcpListener::bind(("0.0.0.0", l.port)) {
                    Ok(listener) => break listener,
                    Err(e)
                        if e.kind() == std::io::ErrorKind::AddrInUse
                            && Instant::now() < give_up =>
                    {
                        std::thread::sleep(Duration::from_millis(50))
                    }
                    Err(e) => return Err(io(&format!("cannot listen on port {}", l.port), e)),
                }
            };
            listener
                .set_nonblocking(true)
                .map_err(|e| io("listen", e))?;
            let mut joined = 1;
            while joined < l.world {
                match listener.accept() {
                    Ok((mut s, from)) => {
                        s.set_nonblocking(false).map_err(|e| io("accept", e))?;
                        s.set_read_timeout(Some(remaining(deadline)))
                            .map_err(|e| io("accept", e))?;
                        let mut hello = [0u8; 16];
                        s.read_exact(&mut hello)
                            .map_err(|e| io(&format!("hello from {from}"), e))?;
                        let rank = u32::from_le_bytes(hello[8..12].try_into().unwrap()) as usize;
                        let world = u32::from_le_bytes(hello[12..16].try_into().unwrap()) as usize;
                        if &hello[..8] != MAGIC {
                            crate::bail!(
                                Runtime,
                                "rendezvous: {from} is not a graphrun process (port {})",
                                l.port
                            );
                        }
                        if world != l.world || rank == 0 || rank >= l.world {
                            crate::bail!(
                                Runtime,
                                "rendezvous: {from} says it is rank {rank} of {world} processes; \
                                 this is rank 0 of {}",
                                l.world
                            );
                        }
                        if streams[rank].is_some() {
                            crate::bail!(Runtime, "rendezvous: rank {rank} joined twice");
                        }
                        streams[rank] = Some(s);
                        joined += 1;
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        if Instant::now() >= deadline {
                            let missing: Vec<String> = (1..l.world)
                                .filter(|&r| streams[r].is_none())
                                .map(|r| r.to_string())
                                .collect();
                            crate::bail!(
                                Runtime,
                                "rendezvous: rank{} {} did not join within {} s (port {})",
                                if missing.len() > 1 { "s" } else { "" },
                                missing.join(", "),
                                timeout.as_secs(),
                                l.port
                            );
                        }
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    Err(e) => return Err(io("accept", e)),
                }
            }
            data = payload()?;
            for s in streams.iter_mut().flatten() {
                let len = (data.len() as u32).to_le_bytes();
                s.write_all(&len)
                    .and_then(|_| s.write_all(&data))
                    .map_err(|e| io("sending the id", e))?;
                s.set_read_timeout(None).map_err(|e| io("rendezvous", e))?;
            }
        } else {
            let addrs: Vec<_> = (l.addr.as_str(), l.port)
                .to_socket_addrs()
                .map_err(|e| io(&format!("cannot resolve MASTER_ADDR {:?}", l.addr), e))?
                .collect();
            let mut s = loop {
                // A connection to a port nothing listens on yet can meet itself (TCP's
                // simultaneous open, when the kernel hands out that very port as this end's):
                // it would hold the port process 0 is about to listen on, so drop it.
                let to_other = |s: &TcpStream| match (s.local_addr(), s.peer_addr()) {
                    (Ok(a), Ok(b)) => a != b,
                    _ => false,
                };
                if let Some(s) = addrs.iter().find_map(|a| {
                    TcpStream::connect_timeout(a, Duration::from_secs(1))
                        .ok()
                        .filter(to_other)
                }) {
                    break s;
                }
                if Instant::now() >= deadline {
                    crate::bail!(
                        Runtime,
                        "rendezvous: rank 0 at {}:{} did not answer within {} s",
                        l.addr,
                        l.port,
                        timeout.as_secs()
                    );
                }
                std::thread::sleep(Duration::from_millis(100));
            };
            let mut hello = [0u8; 16];
            hello[..8].copy_from_slice(MAGIC);
            hello[8..12].copy_from_slice(&(l.rank as u32).to_le_bytes());
            hello[12..16].copy_from_slice(&(l.world as u32).to_le_bytes());
            s.write_all(&hello).map_err(|e| io("hello", e))?;
            s.set_read_timeout(Some(remaining(deadline)))
                .map_err(|e| io("rendezvous", e))?;
            let mut len = [0u8; 4];
            s.read_exact(&mut len)
                .map_err(|e| io("waiting for rank 0", e))?;
            let n = u32::from_le_bytes(len) as usize;
            if n > 4096 {
                crate::bail!(
                    Runtime,
                    "rendezvous: rank 0 sent {n} bytes (not graphrun's)"
                );
            }
            let mut d = vec![0u8; n];
            s.read_exact(&mut d)
                .map_err(|e| io("waiting for rank 0", e))?;
            s.set_read_timeout(None).map_err(|e| io("rendezvous", e))?;
            data = d;
            streams[0] = Some(s);
        }
        let link = Link {
            rank: l.rank,
            streams: Arc::new(Mutex::new(streams)),
            failure: Arc::new(Mutex::new(None)),
            finished: std::sync::atomic::AtomicBool::new(false),
        };
        Ok((data, link))
    }

    /// Watches the connections on background threads: when a peer reports a failure or
    /// its connection breaks, the failure is noted (`failure`), passed on (process 0)
    /// and `abort` is called once.
    pub fn watch(&self, abort: Arc<dyn Fn() + Send + Sync>) -> Result<()> {
        let readers: Vec<(usize, TcpStream)> = {
            let st = self.streams.lock().map_err(|_| poisoned())?;
            st.iter()
                .enumerate()
                .filter_map(|(r, s)| Some((r, s.as_ref()?.try_clone().ok()?)))
                .collect()
        };
        for (peer, mut s) in readers {
            let (failure, streams, me) = (self.failure.clone(), self.streams.clone(), self.rank);
            let abort = abort.clone();
            std::thread::Builder::new()
                .name(format!("graphrun-link{peer}"))
                .spawn(move || {
                    let mut buf = Vec::new();
                    // Blocks until the peer says something or goes away.
                    let _ = s.read_to_end(&mut buf);
                    let said = String::from_utf8_lossy(&buf).trim().to_string();
                    if said == DONE {
                        return;
                    }
                    let msg = if said.is_empty() {
                        format!("rank {peer} stopped (its connection closed)")
                    } else {
                        said
                    };
                    note(&failure, &streams, me, &msg);
                    abort();
                })
                .map_err(|e| crate::err!(Runtime, "cannot start a watch thread: {e}"))?;
        }
        Ok(())
    }

    /// Tells every peer (through process 0) that this process failed, with `msg`, and
    /// closes the connections.
    pub fn fail(&self, msg: &str) {
        note(&self.failure, &self.streams, self.rank, msg);
    }

    /// Marks this process's part as done: dropping the link then tells the peers so,
    /// rather than that this process stopped.
    pub fn finish(&self) {
        self.finished
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// The first failure heard from a peer (or told `fail`).
    pub fn failure(&self) -> Option<String> {
        self.failure.lock().ok()?.clone()
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        // A clean end says so, that the peers do not take the closed connection for a
        // process that died; any other end (an error, a panic) is a failure to them.
        let failed =
            self.failure().is_some() || !self.finished.load(std::sync::atomic::Ordering::SeqCst);
        if let Ok(mut st) = self.streams.lock() {
            for s in st.iter_mut().flatten() {
                if !failed {
                    let _ = s.write_all(DONE.as_bytes());
                }
                let _ = s.shutdown(std::net::Shutdown::Both);
            }
        }
    }
}

/// What a process that ends cleanly sends before it closes.
const DONE: &str = "done";

/// Records the first failure and sends it down every connection (which process 0 has
/// to all, the others to process 0), then closes them.
fn note(
    failure: &Mutex<Option<String>>,
    streams: &Mutex<Vec<Option<TcpStream>>>,
    me: usize,
    msg: &str,
) {
    let first = match failure.lock() {
        Ok(mut f) if f.is_none() => {
            *f = Some(msg.to_string());
            true
        }
        _ => false,
    };
    if !first {
        return;
    }
    let line = if msg.starts_with("rank ") {
        msg.to_string()
    } else {
        format!("rank {me}: {msg}")
    };
    if let Ok(mut st) = streams.lock() {
        for s in st.iter_mut().flatten() {
            let _ = s.write_all(line.as_bytes());
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}

fn remaining(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1))
}

fn poisoned() -> crate::error::Error {
    crate::err!(Runtime, "rendezvous state poisoned")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars<'a>(v: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |n| v.iter().find(|(k, _)| *k == n).map(|(_, x)| x.to_string())
    }

    #[test]
    fn the_launchers_environments_are_read() {
        assert_eq!(Launch::from_vars(vars(&[])).unwrap(), None);
        assert_eq!(
            Launch::from_vars(vars(&[("WORLD_SIZE", "1")])).unwrap(),
            None
        );
        let torchrun = [
            ("WORLD_SIZE", "4"),
            ("RANK", "3"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29500"),
        ];
        let l = Launch::from_vars(vars(&torchrun)).unwrap().unwrap();
        assert_eq!((l.rank, l.world, l.local_rank, l.port), (3, 4, 1, 29500));
        assert_eq!(l.addr, "node0");
        let mut agent = torchrun.to_vec();
        agent.push(("TORCHELASTIC_USE_AGENT_STORE", "True"));
        assert_eq!(
            Launch::from_vars(vars(&agent)).unwrap().unwrap().port,
            29501
        );
        agent.push(("GRAPHRUN_RENDEZVOUS_PORT", "4000"));
        assert_eq!(Launch::from_vars(vars(&agent)).unwrap().unwrap().port, 4000);
        let slurm = [
            ("SLURM_NTASKS", "2"),
            ("SLURM_PROCID", "1"),
            ("SLURM_LOCALID", "0"),
            ("MASTER_ADDR", "a"),
            ("MASTER_PORT", "1234"),
        ];
        let l = Launch::from_vars(vars(&slurm)).unwrap().unwrap();
        assert_eq!((l.rank, l.world, l.local_rank), (1, 2, 0));
        for (bad, says) in [
            (vec![("WORLD_SIZE", "2"), ("RANK", "2")], "not below"),
            (vec![("WORLD_SIZE", "two")], "WORLD_SIZE"),
            (vec![("WORLD_SIZE", "2")], "no rank"),
            (vec![("WORLD_SIZE", "2"), ("RANK", "1")], "MASTER_ADDR"),
            (
                vec![
                    ("WORLD_SIZE", "2"),
                    ("RANK", "1"),
                    ("MASTER_ADDR", "a"),
                    ("MASTER_PORT", "x"),
                ],
                "not a port",
            ),
        ] {
            let e = Launch::from_vars(vars(&bad)).unwrap_err().to_string();
            assert!(e.contains(says), "{e}");
        }
    }

    /// Three processes (threads here) meet, get rank 0's payload, and a failure in one
    /// reaches the others with its message.
    #[test]
    fn rendezvous_hands_out_the_id_and_carries_failures() {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let launch = move |rank| Launch {
            rank,
            world: 3,
            local_rank: rank,
            addr: "127.0.0.1".into(),
            port,
        };
        let t = Duration::from_secs(20);
        let hs: Vec<_> = (1..3)
            .map(|r| std::thread::spawn(move || Link::join(&launch(r), t, || unreachable!())))
            .collect();
        let (d0, l0) = Link::join(&launch(0), t, || Ok(b"the id".to_vec())).unwrap();
        assert_eq!(d0, b"the id");
        let links: Vec<Link> = hs
            .into_iter()
            .map(|h| {
                let (d, l) = h.join().unwrap().unwrap();
                assert_eq!(d, b"the id");
                l
            })
            .collect();
        let aborted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        for l in [&l0, &links[0], &links[1]] {
            let a = aborted.clone();
            l.watch(Arc::new(move || {
                a.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }))
            .unwrap();
        }
        links[1].fail("out of memory on GPU 2");
        let t0 = Instant::now();
        // (The failing rank's own watcher may abort too, as its connection closes: wait
        // for the two others rather than for any two aborts.)
        while l0.failure().is_none()
            || links[0].failure().is_none()
            || aborted.load(std::sync::atomic::Ordering::SeqCst) < 2
        {
            assert!(t0.elapsed() < Duration::from_secs(10), "no abort");
            std::thread::sleep(Duration::from_millis(10));
        }
        for l in [&l0, &links[0]] {
            let f = l.failure().unwrap();
            assert!(f.contains("rank 2") && f.contains("out of memory"), "{f}");
        }
        // Nobody joins: rank 0 gives up in time, naming who is missing.
        let lone = Launch {
            port: TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port(),
            ..launch(0)
        };
        let e = Link::join(&lone, Duration::from_millis(300), || Ok(vec![]))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("ranks 1, 2 did not join"), "{e}");
    }
}
