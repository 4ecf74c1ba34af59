//! The node slabs' magazine layer, modelled with the crate's own `MagPair`,
//! `Depot` and `RemoteList` (the slab mapping around them is not loom-able).
//!
//! * Depot exchange: two threads, each with its own magazine pair of one
//!   round, allocate and free objects, trading whole magazines through one
//!   node's depot (bounded to one full magazine, so the "depot full, back to
//!   the slabs" path runs too) with a mutex-guarded pool standing in for the
//!   slabs. Checked: no object is held by two threads at once (each object's
//!   payload is a loom cell written by its holder), and at the end every
//!   object is in exactly one place.
//! * Remote free: a thread on another node sends objects home on the node's
//!   `RemoteList` (one single push and one two-object chain) while the
//!   node drains it. Checked: each object arrives once, with the payload the
//!   freeing thread wrote visible to the node.
#![cfg(loom)]

use std::collections::BTreeSet;
use std::ptr::NonNull;

use loom::cell::UnsafeCell;
use loom::sync::{Arc, Mutex};
use loom::thread;
use numaweave::slab::magazine::{Depot, MagPair, RemoteList};

/// An object: a link word first (as a slab object without constructor) and a payload.
#[repr(C)]
struct Obj {
    link: *mut u8,
    payload: UnsafeCell<usize>,
}

struct World {
    objs: Vec<Obj>,
    depot: Depot,
    slabs: Mutex<Vec<usize>>,
    remote: RemoteList,
}

// SAFETY: objects are handed between threads only through the structures
// under test, which is what the model checks.
unsafe impl Send for World {}
// SAFETY: as above.
unsafe impl Sync for World {}

impl World {
    fn new(n: usize, max_full: usize) -> Arc<Self> {
        Arc::new(Self {
            objs: (0..n).map(|i| Obj { link: std::ptr::null_mut(), payload: UnsafeCell::new(i) }).collect(),
            depot: Depot::new(max_full, 1),
            slabs: Mutex::new((0..n).collect()),
            remote: RemoteList::new(),
        })
    }
    fn ptr(&self, i: usize) -> NonNull<u8> {
        NonNull::from(&self.objs[i]).cast()
    }
    fn index(&self, p: *mut u8) -> usize {
        (p as usize - self.objs.as_ptr() as usize) / size_of::<Obj>()
    }
}

/// Bonwick's allocation: loaded, else previous or a depot magazine, else the slabs.
fn alloc(w: &World, pair: &mut MagPair) -> Option<usize> {
    if let Some(p) = pair.pop() {
        return Some(w.index(p.as_ptr()));
    }
    if pair.reload(&w.depot) {
        return Some(w.index(pair.pop().expect("reloaded").as_ptr()));
    }
    let i = w.slabs.lock().unwrap().pop()?;
    Some(i)
}

fn free(w: &World, pair: &mut MagPair, i: usize) {
    while !pair.push(w.ptr(i)) {
        if !pair.unload(&w.depot) {
            let prev = pair.previous_mut();
            let mut s = w.slabs.lock().unwrap();
            s.extend(prev.as_slice().iter().map(|&p| w.index(p)));
            prev.clear();
        }
    }
}

#[test]
fn depot_exchange_never_shares_or_loses_an_object() {
    loom::model(|| {
        let w = World::new(3, 1);
        let worker = |w: Arc<World>, tag: usize| {
            move || {
                let mut pair = MagPair::new(1);
                let mut held = Vec::new();
                for _ in 0..2 {
                    if let Some(i) = alloc(&w, &mut pair) {
                        // SAFETY (loom-checked): only the holder touches it.
                        w.objs[i].payload.with_mut(|p| unsafe { *p = tag });
                        held.push(i);
                    }
                }
                for i in held {
                    w.objs[i].payload.with(|p| assert_eq!(unsafe { *p }, tag));
                    free(&w, &mut pair, i);
                }
                pair
            }
        };
        let a = thread::spawn(worker(w.clone(), 100));
        let b = thread::spawn(worker(w.clone(), 200));
        let (mut pa, mut pb) = (a.join().unwrap(), b.join().unwrap());
        let mut seen = Vec::new();
        for pair in [&mut pa, &mut pb] {
            for m in pair.magazines_mut() {
                seen.extend(m.as_slice().iter().map(|&p| w.index(p)));
                m.clear();
            }
        }
        for m in w.depot.take_full() {
            seen.extend(m.as_slice().iter().map(|&p| w.index(p)));
        }
        seen.extend(w.slabs.lock().unwrap().iter().copied());
        seen.sort_unstable();
        assert_eq!(seen, vec![0, 1, 2], "an object was lost or is in two places");
    });
}

#[test]
fn remote_frees_arrive_once_with_their_contents() {
    remote_model(false);
}

/// Negative control: the freeing thread writes the first object's payload
/// after pushing it. Loom must find the drain reading the payload before
/// the write and report the race; if this test stopped panicking, the
/// model above would prove nothing.
#[test]
#[should_panic(expected = "Causality violation")]
fn planted_write_after_the_push_is_caught() {
    remote_model(true);
}

fn remote_model(write_after_push: bool) {
    loom::model(move || {
        let w = World::new(3, 1);
        let link = std::mem::offset_of!(Obj, link);
        let remote = {
            let w = w.clone();
            thread::spawn(move || {
                let write = |i: usize| {
                    // SAFETY (loom-checked): the freeing thread owns them.
                    w.objs[i].payload.with_mut(|p| unsafe { *p = 1000 + i });
                };
                for i in usize::from(write_after_push)..3 {
                    write(i);
                }
                // SAFETY: objects 0..3 are ours and free; link words are at `link`.
                unsafe {
                    w.remote.push_chain(w.ptr(0), w.ptr(0), link);
                    if write_after_push {
                        write(0);
                    }
                    // A bulk free: 1 -> 2 linked first, pushed as one chain.
                    w.ptr(1).as_ptr().add(link).cast::<*mut u8>().write(w.ptr(2).as_ptr());
                    w.remote.push_chain(w.ptr(1), w.ptr(2), link);
                }
            })
        };
        let drain = |w: &World, got: &mut BTreeSet<usize>| {
            let mut p = w.remote.take_all();
            while !p.is_null() {
                let i = w.index(p);
                w.objs[i].payload.with(|v| assert_eq!(unsafe { *v }, 1000 + i));
                assert!(got.insert(i), "object {i} arrived twice");
                // SAFETY: a taken object's link word holds the next one.
                p = unsafe { p.add(link).cast::<*mut u8>().read() };
            }
        };
        // The node drains while the pushes happen (a drain racing a push is
        // the case to check), until every object is home.
        let mut got = BTreeSet::new();
        while got.len() < 3 {
            drain(&w, &mut got);
            thread::yield_now();
        }
        remote.join().unwrap();
        assert_eq!(got.into_iter().collect::<Vec<_>>(), vec![0, 1, 2]);
    });
}
