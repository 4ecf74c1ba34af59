//! A NUMA-node-aware tokio runtime: one worker group per node.
//!
//! A tokio runtime on a machine of several nodes spreads its workers over
//! every CPU, steals tasks across nodes and serves a connection wherever a
//! worker was free (tokio issue #5076: hello-world servers on a 4-node
//! machine with cores 80% idle). [`NodeRuntime`] is a multi-threaded tokio
//! runtime per node instead, as Seastar shards are per core:
//!
//! - each node's workers (and its blocking threads) are pinned to the
//!   node's CPUs that the process may use, so work stealing stays within
//!   the node;
//! - with [`numaweave::NumaAlloc`] as the global allocator, whose default
//!   policy allocates on the thread's node, a task's memory comes from its
//!   workers' node, and a block freed by another node's worker goes home;
//! - [`NodeRuntime::spawn_on`] puts a task on a node (the one of the device
//!   it talks to, or of the data it owns);
//! - [`NodeRuntime::listen`] binds a listener per node to one address
//!   (`SO_REUSEPORT`): the kernel spreads connections over them by hash,
//!   preferring, for a connection whose first packet was handled on a
//!   listener's `SO_INCOMING_CPU` (the node's first CPU), that listener;
//!   each is served on the node whose listener accepted it;
//! - with the `io-uring` feature, `Builder::rings` gives each thread that
//!   asks (`with_ring`) a `NodeRing` cloned from its node's `NodeTable`
//!   (numaweave's `io::uring`): fixed buffers registered once per node.
//!
//! Drop a `NodeRuntime` outside async code, as a tokio `Runtime`.
//!
//! The allocator crate does not depend on tokio; this crate does.
//!
//! ```no_run
//! use numaweave::NumaAlloc;
//! use numaweave_tokio::NodeRuntime;
//!
//! #[global_allocator]
//! static A: NumaAlloc = NumaAlloc::new();
//!
//! let rt = NodeRuntime::builder().workers_per_node(2).build().unwrap();
//! for node in rt.nodes() {
//!     let task = rt.spawn_on(node, async move {
//!         // Runs on one of `node`'s workers; its memory is node-local.
//!         (numaweave_tokio::current_node(), vec![0u8; 4096].len())
//!     });
//!     assert_eq!(rt.block_on(task).unwrap(), (Some(node), 4096));
//! }
//! ```

use std::cell::Cell;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use numaweave::{Error, Topology};
use tokio::runtime::{Handle, Runtime};
use tokio::task::JoinHandle;

thread_local! {
    /// The node of the worker group the calling thread belongs to.
    static NODE: Cell<Option<usize>> = const { Cell::new(None) };
}

#[cfg(feature = "io-uring")]
type RingSource = (Arc<numaweave::io::uring::NodeTable>, u32);

#[cfg(feature = "io-uring")]
thread_local! {
    /// The calling thread's ring, cloned from its node's table when first
    /// asked for (a blocking thread that never asks makes none).
    static RING: std::cell::RefCell<Option<numaweave::io::uring::NodeRing>> = const { std::cell::RefCell::new(None) };
    /// Where it comes from: the node's table and the ring's entries.
    static RING_SOURCE: std::cell::RefCell<Option<RingSource>> = const { std::cell::RefCell::new(None) };
}

/// The node of the calling thread's worker group: `Some` on a worker (or
/// blocking thread) of a [`NodeRuntime`], `None` elsewhere.
///
/// ```
/// assert_eq!(numaweave_tokio::current_node(), None);
/// ```
pub fn current_node() -> Option<usize> {
    NODE.with(Cell::get)
}

/// Calls `f` with the calling worker's ring (see [`Builder::rings`]), made
/// from its node's table at the thread's first call: `Ok(None)` off a
/// worker, or on a runtime built without rings; the error of making it.
///
/// ```no_run
/// let rt = numaweave_tokio::NodeRuntime::builder().rings(4096, 64).build().unwrap();
/// let task = rt.spawn_on(0, async {
///     numaweave_tokio::with_ring(|ring| ring.alloc().map(|b| b.index()).unwrap())
/// });
/// println!("buffer index {:?}", rt.block_on(task).unwrap());
/// ```
#[cfg(feature = "io-uring")]
pub fn with_ring<R>(f: impl FnOnce(&numaweave::io::uring::NodeRing) -> R) -> Result<Option<R>, Error> {
    RING.with(|r| {
        if r.borrow().is_none() {
            let Some((table, entries)) = RING_SOURCE.with(|s| s.borrow().clone()) else { return Ok(None) };
            let ring = table.ring(entries)?;
            *r.borrow_mut() = Some(ring);
        }
        // (A shared borrow: `f` may call `with_ring` again.)
        Ok(r.borrow().as_ref().map(f))
    })
}

/// How a [`NodeRuntime`] is made: see [`NodeRuntime::builder`].
#[derive(Clone, Debug, Default)]
pub struct Builder {
    nodes: Option<Vec<usize>>,
    workers: Option<usize>,
    #[cfg(feature = "io-uring")]
    rings: Option<(usize, u32)>,
}

impl Builder {
    /// The nodes to run on (default: every node with CPUs).
    pub fn nodes(mut self, nodes: &[usize]) -> Self {
        self.nodes = Some(nodes.to_vec());
        self
    }

    /// Workers per node (default: the node's CPUs).
    pub fn workers_per_node(mut self, workers: usize) -> Self {
        self.workers = Some(workers);
        self
    }

    /// A ring per worker, of `entries` submission entries, cloned from its
    /// node's table of `buf_size`-byte fixed buffers (one
    /// [`NodeTable`](numaweave::io::uring::NodeTable) per node: pinned
    /// once for all its workers); reached with [`with_ring`].
    #[cfg(feature = "io-uring")]
    pub fn rings(mut self, buf_size: usize, entries: u32) -> Self {
        self.rings = Some((buf_size, entries));
        self
    }

    /// Makes the runtime: per node, a multi-threaded tokio runtime whose
    /// threads are pinned to the node's CPUs the process may use (by
    /// default, every node with such CPUs). Fails with
    /// [`Error::InvalidNode`] for a node asked for without such CPUs, or
    /// with the error of the runtime, a table, or the pinning.
    pub fn build(self) -> Result<NodeRuntime, Error> {
        let mut groups = Vec::new();
        // Threads whose pinning fails after the build (blocking threads).
        let unpinned = Arc::new(AtomicUsize::new(0));
        match self.build_groups(&mut groups, &unpinned) {
            Ok(()) => Ok(NodeRuntime { groups, unpinned }),
            Err(e) => {
                // Shut down without waiting: dropping a runtime from async
                // code would panic.
                for g in groups {
                    g.rt.shutdown_background();
                }
                Err(e)
            }
        }
    }

    fn build_groups(self, groups: &mut Vec<Group>, unpinned: &Arc<AtomicUsize>) -> Result<(), Error> {
        let topo = Topology::global();
        let allowed = numaweave::os::cpu::allowed_cpus()?;
        let usable =
            |node: usize| -> Vec<usize> { topo.cpus_of(node).iter().filter(|c| allowed.contains(c)).collect() };
        let nodes = match self.nodes {
            Some(n) => n,
            None => topo.cpu_nodes().iter().filter(|&n| !usable(n).is_empty()).collect(),
        };
        for node in nodes {
            let cpus = usable(node);
            if cpus.is_empty() {
                return Err(Error::InvalidNode { node, reason: "no CPU of the node is allowed to the process" });
            }
            #[cfg(feature = "io-uring")]
            let table = match self.rings {
                Some((size, _)) => Some(numaweave::io::uring::NodeTable::new(node, size)?),
                None => None,
            };
            let pinned: Arc<std::sync::Mutex<Option<Error>>> = Arc::default();
            let (on_cpus, failed) = (cpus.clone(), pinned.clone());
            let started = Arc::new(AtomicUsize::new(0));
            let seen = started.clone();
            #[cfg(feature = "io-uring")]
            let source = table.clone().map(|t| (t, self.rings.map_or(0, |r| r.1)));
            let late = unpinned.clone();
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(self.workers.unwrap_or(cpus.len()).max(1))
                .thread_name(format!("numaweave-node{node}"))
                .enable_all()
                .on_thread_start(move || {
                    NODE.with(|n| n.set(Some(node)));
                    if let Err(e) = numaweave::os::cpu::pin_current_thread_to(on_cpus.iter().copied()) {
                        // At start-up the build's error; later (a blocking
                        // thread) counted.
                        *failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                        late.fetch_add(1, Ordering::Relaxed);
                    }
                    #[cfg(feature = "io-uring")]
                    RING_SOURCE.with(|s| *s.borrow_mut() = source.clone());
                    started.fetch_add(1, Ordering::Release);
                })
                .on_thread_stop(|| {
                    #[cfg(feature = "io-uring")]
                    RING.with(|slot| slot.borrow_mut().take());
                })
                .build()
                .map_err(|e| Error::Os { call: "tokio runtime", errno: e.raw_os_error().unwrap_or(libc::EAGAIN) })?;
            // Every worker started (and pinned, its ring made) before the
            // runtime is handed out: a failure is this call's error.
            let workers = self.workers.unwrap_or(cpus.len()).max(1);
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while seen.load(Ordering::Acquire) < workers && std::time::Instant::now() < deadline {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            if let Some(e) = pinned.lock().unwrap_or_else(|p| p.into_inner()).take() {
                rt.shutdown_background();
                return Err(e);
            }
            groups.push(Group {
                node,
                cpus,
                rt,
                #[cfg(feature = "io-uring")]
                table,
            });
        }
        if groups.is_empty() {
            return Err(Error::InvalidNode { node: 0, reason: "no node to run on" });
        }
        Ok(())
    }
}

/// One node's workers.
struct Group {
    node: usize,
    cpus: Vec<usize>,
    rt: Runtime,
    #[cfg(feature = "io-uring")]
    table: Option<Arc<numaweave::io::uring::NodeTable>>,
}

/// A tokio runtime per node: see the [crate documentation](crate).
pub struct NodeRuntime {
    groups: Vec<Group>,
    unpinned: Arc<AtomicUsize>,
}

impl NodeRuntime {
    /// A builder: every node with CPUs, a worker per CPU, no rings.
    pub fn builder() -> Builder {
        Builder::default()
    }

    /// The nodes it runs on, in the order given.
    pub fn nodes(&self) -> Vec<usize> {
        self.groups.iter().map(|g| g.node).collect()
    }

    fn group(&self, node: usize) -> Option<&Group> {
        self.groups.iter().find(|g| g.node == node)
    }

    /// The tokio handle of `node`'s workers (spawn, enter, block on), if
    /// the runtime runs there.
    pub fn handle(&self, node: usize) -> Option<&Handle> {
        self.group(node).map(|g| g.rt.handle())
    }

    /// Threads started after the build (blocking threads) whose pinning
    /// the kernel refused: they run unpinned (the CPUs allowed to the
    /// process changed under it).
    pub fn unpinned_threads(&self) -> usize {
        self.unpinned.load(Ordering::Relaxed)
    }

    /// The CPUs `node`'s workers are pinned to.
    pub fn cpus(&self, node: usize) -> Option<&[usize]> {
        self.group(node).map(|g| g.cpus.as_slice())
    }

    /// `node`'s table of fixed buffers, with [`Builder::rings`].
    #[cfg(feature = "io-uring")]
    pub fn table(&self, node: usize) -> Option<&Arc<numaweave::io::uring::NodeTable>> {
        self.group(node).and_then(|g| g.table.as_ref())
    }

    /// Runs `fut` on one of `node`'s workers. Panics if the runtime does
    /// not run on `node` (see [`nodes`](Self::nodes)), as tokio's `spawn`
    /// panics outside a runtime.
    pub fn spawn_on<F>(&self, node: usize, fut: F) -> JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        match self.handle(node) {
            Some(h) => h.spawn(fut),
            None => panic!("numaweave-tokio: the runtime does not run on node {node}"),
        }
    }

    /// Blocks the calling thread on `fut` (it runs on the calling thread:
    /// spawn it on a node to run it there).
    pub fn block_on<F: Future>(&self, fut: F) -> F::Output {
        self.groups[0].rt.block_on(fut)
    }

    /// A listener per node, all on `addr` (`SO_REUSEPORT`; port 0 picks one
    /// port for all of them), each registered with its node's workers. The
    /// kernel spreads connections over them by hash, preferring the
    /// listener whose `SO_INCOMING_CPU` (its node's first CPU) handled the
    /// connection's first packet. Accept on each from a task of its node
    /// ([`spawn_on`](Self::spawn_on)): a connection is then served by the
    /// node whose listener accepted it.
    pub fn listen(&self, addr: SocketAddr) -> std::io::Result<Vec<(usize, tokio::net::TcpListener)>> {
        use socket2::{Domain, Protocol, Socket, Type};
        let mut out = Vec::with_capacity(self.groups.len());
        let mut addr = addr;
        for g in &self.groups {
            let s = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
            s.set_reuse_port(true)?;
            s.set_reuse_address(true)?;
            // Best effort: a kernel without it picks by hash.
            let _ = s.set_cpu_affinity(g.cpus[0]);
            s.set_nonblocking(true)?;
            s.bind(&addr.into())?;
            s.listen(1024)?;
            if addr.port() == 0 {
                addr = s.local_addr()?.as_socket().unwrap_or(addr);
            }
            let _enter = g.rt.enter();
            out.push((g.node, tokio::net::TcpListener::from_std(s.into())?));
        }
        Ok(out)
    }
}
