//! fork() while other threads allocate: the child must be able to allocate.
//! Without the allocator's `pthread_atfork` handlers a child forked while
//! another thread held an arena lock waits on it forever.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use numaweave::NumaAlloc;

#[global_allocator]
static A: NumaAlloc = NumaAlloc::new();

#[test]
fn children_forked_during_allocation_can_allocate() {
    static STOP: AtomicBool = AtomicBool::new(false);
    // Churn that takes the arena lock all the time: 64 KiB blocks need a
    // fresh 256 KiB page every four, and freeing them hands pages back.
    let churners: Vec<_> = (0..2)
        .map(|_| {
            std::thread::spawn(|| {
                while !STOP.load(Ordering::Relaxed) {
                    let v: Vec<Vec<u8>> = (0..64).map(|i| vec![i as u8; 64 << 10]).collect();
                    std::hint::black_box(&v);
                }
            })
        })
        .collect();
    for round in 0..300 {
        // SAFETY: the child only allocates, checks and _exits.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            let v: Vec<Vec<u8>> = (0..64).map(|i| vec![i as u8; 64 << 10]).collect();
            let ok = v.iter().enumerate().all(|(i, b)| b[(64 << 10) - 1] == i as u8);
            // SAFETY: leaves the child without running the parent's destructors.
            unsafe { libc::_exit(if ok { 0 } else { 1 }) };
        }
        let start = Instant::now();
        let mut status = 0;
        loop {
            // SAFETY: our child's pid; `status` is writable.
            let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
            if r == pid {
                break;
            }
            if start.elapsed() > Duration::from_secs(10) {
                // SAFETY: our child.
                unsafe { libc::kill(pid, libc::SIGKILL) };
                STOP.store(true, Ordering::Relaxed);
                panic!("child {round} hung: it could not allocate after fork");
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "child {round} failed: {status:#x}");
    }
    STOP.store(true, Ordering::Relaxed);
    for c in churners {
        c.join().unwrap();
    }
}
