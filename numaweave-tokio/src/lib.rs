//! A NUMA-node-aware tokio runtime: one worker group per node.
//!
//! A tokio runtime on a machine of several nodes spreads its workers over
//! every CPU, steals tasks across nodes and serves a connection wherever a
//! worker was free (tokio issue #5076: hello-world servers on a 4-node
//! machine with cores 80% idle). [`NodeRuntime`] is a multi-threaded tokio
//! runtime per node instead, as Seastar shards are per core:
//!
//! - each node's workers (and its blocking threads) are pinned to the
//!   node's CPUs, so work stealing stays within the node;
//! - with [`numaweave::NumaAlloc`] as the global allocator, whose default
//!   policy allocates on the thread's node, a task's memory comes from its
//!   workers' node, and a block freed by another node's worker goes home;
//! - [`NodeRuntime::spawn_on`] puts a task on a node (the one of the device
//!   it talks to, or of the data it owns);
//! - [`NodeRuntime::listen`] binds a listener per node to one address
//!   (`SO_REUSEPORT`, each steered to connections arriving on its node's
//!   CPUs with `SO_INCOMING_CPU`), so a connection is served where it
//!   arrived;
//! - with the `io-uring` feature, [`Builder::rings`] gives each worker a
//!   [`NodeRing`](numaweave::io::uring::NodeRing) cloned from its node's
//!   [`NodeTable`](numaweave::io::uring::NodeTable): fixed buffers
//!   registered once per node ([`with_ring`]).
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
thread_local! {
    /// The calling worker's ring, cloned from its node's table.
    static RING: std::cell::RefCell<Option<numaweave::io::uring::NodeRing>> = const { std::cell::RefCell::new(None) };
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

/// Calls `f` with the calling worker's ring (see [`Builder::rings`]):
/// `None` off a worker, or on a runtime built without rings.
///
/// ```no_run
/// let rt = numaweave_tokio::NodeRuntime::builder().rings(4096, 64).build().unwrap();
/// let task = rt.spawn_on(0, async {
///     numaweave_tokio::with_ring(|ring| ring.alloc().map(|b| b.index()).unwrap())
/// });
/// println!("buffer index {:?}", rt.block_on(task).unwrap());
/// ```
#[cfg(feature = "io-uring")]
pub fn with_ring<R>(f: impl FnOnce(&numaweave::io::uring::NodeRing) -> R) -> Option<R> {
    RING.with(|r| r.borrow().as_ref().map(f))
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
    /// threads are pinned to the node's CPUs. Fails with
    /// [`Error::InvalidNode`] for a node without CPUs, or with the error of
    /// the runtime, a table, or the pinning.
    pub fn build(self) -> Result<NodeRuntime, Error> {
        let topo = Topology::global();
        let nodes = match self.nodes {
            Some(n) => n,
            None => topo.cpu_nodes().iter().collect(),
        };
        let mut groups = Vec::with_capacity(nodes.len());
        for node in nodes {
            let cpus: Vec<usize> = topo.cpus_of(node).iter().collect();
            if cpus.is_empty() {
                return Err(Error::InvalidNode { node, reason: "the node has no CPUs for workers" });
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
            let (ring_table, entries) = (table.clone(), self.rings.map_or(0, |r| r.1));
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(self.workers.unwrap_or(cpus.len()).max(1))
                .thread_name(format!("numaweave-node{node}"))
                .enable_all()
                .on_thread_start(move || {
                    NODE.with(|n| n.set(Some(node)));
                    if let Err(e) = numaweave::os::cpu::pin_current_thread_to(on_cpus.iter().copied()) {
                        *failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                    }
                    #[cfg(feature = "io-uring")]
                    if let Some(t) = &ring_table {
                        match t.ring(entries) {
                            Ok(r) => RING.with(|slot| *slot.borrow_mut() = Some(r)),
                            Err(e) => *failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(e),
                        }
                    }
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
        Ok(NodeRuntime { groups })
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
    /// port for all of them), each registered with its node's workers and
    /// steered, where the kernel does it, to connections whose packets
    /// arrive on the node's first CPU (`SO_INCOMING_CPU`). Accept on each
    /// from a task of its node ([`spawn_on`](Self::spawn_on)): a connection
    /// is then served by the node it arrived on.
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
