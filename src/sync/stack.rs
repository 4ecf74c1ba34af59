//! An intrusive multi-producer, single-consumer stack: any thread pushes one
//! node, the one consumer takes the whole stack at once.
//!
//! This is the shape of every remote free in the allocator: a thread freeing a
//! block it does not own pushes the block onto the owning page's list, and the
//! owner later takes the whole list with one swap. Because the consumer never
//! pops single nodes, there is no ABA problem and no need for tags or hazard
//! pointers.

use core::ptr;

use super::shim::{AtomicPtr, AtomicUsize, Ordering};

/// A node type that can be linked into an [`AtomicStack`] through a `next`
/// pointer stored inside it.
///
/// # Safety
/// `next_ptr` must return a pointer to storage inside `node` that is valid
/// for reads and writes while the node is on a stack, and that nothing else
/// uses during that time.
pub unsafe trait Linked {
    /// Where the link to the next node is kept.
    ///
    /// # Safety
    /// `node` must point to a live node.
    unsafe fn next_ptr(node: *mut Self) -> *mut *mut Self;
}

/// The stack; see the module docs. Nodes of a [`Linked`] type are pushed
/// one by one ([`push`](Self::push)); any pointee type can be pushed as a
/// chain the caller links ([`push_chain_by`](Self::push_chain_by)), for
/// nodes whose link is not at a fixed place (a slab object's link word).
pub struct AtomicStack<T> {
    head: AtomicPtr<T>,
}

impl<T> AtomicStack<T> {
    /// An empty stack.
    #[cfg(not(loom))]
    pub const fn new() -> Self {
        Self { head: AtomicPtr::new(ptr::null_mut()) }
    }

    /// An empty stack (loom's atomics are not `const`).
    #[cfg(loom)]
    pub fn new() -> Self {
        Self { head: AtomicPtr::new(ptr::null_mut()) }
    }

    /// Pushes the chain `first ..= last`, whose nodes the caller has linked
    /// to each other; `link(last, head)` makes `last` point at the current
    /// head (called again if another push got in first). Returns true when
    /// the stack was empty before (the allocator uses that edge to tell the
    /// owner, once, that work is waiting).
    ///
    /// # Safety
    /// Every node of the chain must be live, on no stack, and stay live
    /// until the consumer has taken it; `link` may write only `last`'s link.
    #[inline]
    pub unsafe fn push_chain_by(&self, first: *mut T, last: *mut T, mut link: impl FnMut(*mut T, *mut T)) -> bool {
        let mut head = self.head.load(Ordering::Relaxed);
        loop {
            link(last, head);
            // Release: the links (and whatever the pusher wrote into the
            // nodes before) are visible to the consumer that Acquires the
            // head. Acquire: a pusher that finds the stack emptied by
            // `take_all` sees everything the consumer did before emptying
            // it, so it may then write into memory the consumer read (the
            // allocator's page link, reused once the page is enqueued again).
            match self.head.compare_exchange_weak(head, first, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => return head.is_null(),
                Err(h) => head = h,
            }
        }
    }

    /// Takes every node pushed so far, most recent first, as a chain ending
    /// in null.
    #[inline]
    pub fn take_all(&self) -> *mut T {
        // Acquire pairs with the pushers' Release: the links are visible.
        // Release pairs with the next pusher's Acquire (see `push_chain_by`).
        self.head.swap(ptr::null_mut(), Ordering::AcqRel)
    }

    /// Whether the stack looked empty (a racy hint).
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.head.load(Ordering::Relaxed).is_null()
    }
}

impl<T: Linked> AtomicStack<T> {
    /// Pushes `node`; returns true when the stack was empty before.
    ///
    /// # Safety
    /// `node` must be live, not on any stack, and stay live until the consumer
    /// has taken it.
    #[inline]
    pub unsafe fn push(&self, node: *mut T) -> bool {
        // SAFETY: `node` is live, on no stack, and stays live until taken (the caller's
        // word); the closure writes only its link.
        unsafe { self.push_chain_by(node, node, |n, head| *T::next_ptr(n) = head) }
    }
}

impl<T> Default for AtomicStack<T> {
    fn default() -> Self {
        Self::new()
    }
}

/// An [`AtomicStack`] that also counts its nodes, in the same word: the top 16
/// bits of the head hold the count, the low 48 the pointer. The consumer gets
/// the chain and its length in one swap, without walking the chain (whose
/// nodes were last written by other cores: a cache miss each).
///
/// Needs user-space addresses below 2^48 (x86-64 and AArch64 with 4-level
/// page tables, and 5-level ones unless a mapping is asked for above 2^47)
/// and at most 65535 nodes between two `take_all`s (the allocator's pages
/// hold at most 4096 blocks).
pub struct CountedStack<T: Linked> {
    head: AtomicUsize,
    _marker: core::marker::PhantomData<*mut T>,
}

// SAFETY: only raw pointers to nodes the callers hand over travel through it.
unsafe impl<T: Linked> Send for CountedStack<T> {}
// SAFETY: as above; all access is atomic.
unsafe impl<T: Linked> Sync for CountedStack<T> {}

const PTR_BITS: u32 = 48;
const PTR_MASK: usize = (1 << PTR_BITS) - 1;

impl<T: Linked> CountedStack<T> {
    /// An empty stack.
    #[cfg(not(loom))]
    pub const fn new() -> Self {
        Self { head: AtomicUsize::new(0), _marker: core::marker::PhantomData }
    }

    /// An empty stack (loom's atomics are not `const`).
    #[cfg(loom)]
    pub fn new() -> Self {
        Self { head: AtomicUsize::new(0), _marker: core::marker::PhantomData }
    }

    /// Pushes `node`; returns true when the stack was empty before.
    ///
    /// # Safety
    /// As [`AtomicStack::push`]; besides, `node`'s address must be below 2^48
    /// and the stack must hold fewer than 65535 nodes.
    #[inline]
    pub unsafe fn push(&self, node: *mut T) -> bool {
        // SAFETY: `node` is live, on no stack, below 2^48, with room in the count (the
        // caller's word), as `push_by` asks; the closure writes only its link.
        unsafe { self.push_by(node, |n, next| *T::next_ptr(n) = next) }
    }

    /// [`push`](Self::push), with `link(node, head)` making `node` point at
    /// the current head (called again if another push got in first): a
    /// hardened allocator stores its links encoded.
    ///
    /// # Safety
    /// As [`push`](Self::push); `link` may write only `node`'s link.
    #[inline]
    pub unsafe fn push_by(&self, node: *mut T, mut link: impl FnMut(*mut T, *mut T)) -> bool {
        debug_assert_eq!(node as usize & !PTR_MASK, 0, "address above 2^48");
        let mut head = self.head.load(Ordering::Relaxed);
        loop {
            link(node, (head & PTR_MASK) as *mut T);
            let count = (head >> PTR_BITS) + 1;
            let new = (count << PTR_BITS) | node as usize;
            // AcqRel for the same reasons as `AtomicStack::push`.
            match self.head.compare_exchange_weak(head, new, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => return head == 0,
                Err(h) => head = h,
            }
        }
    }

    /// How many nodes it held at one moment of the call (a racy hint, as
    /// [`is_empty`](Self::is_empty): for statistics).
    #[inline]
    pub fn len(&self) -> usize {
        self.head.load(Ordering::Relaxed) >> PTR_BITS
    }

    /// Whether the stack looked empty (a racy hint).
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.head.load(Ordering::Relaxed) == 0
    }

    /// Takes every node pushed so far: the chain (most recent first, linked
    /// through `next`, null-terminated) and its length.
    #[inline]
    pub fn take_all(&self) -> (*mut T, usize) {
        let v = self.head.swap(0, Ordering::AcqRel);
        ((v & PTR_MASK) as *mut T, v >> PTR_BITS)
    }
}

impl<T: Linked> Default for CountedStack<T> {
    fn default() -> Self {
        Self::new()
    }
}
