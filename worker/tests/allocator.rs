//! `keep_freed_memory`: large allocations come from malloc's heap, not from
//! mappings of their own, and stay there once freed. One test in its own
//! binary, so nothing else allocates meanwhile.
#![cfg(all(target_os = "linux", target_env = "gnu"))]
#![allow(unsafe_code)]

/// Bytes malloc holds in mappings of their own, and bytes free in its heaps.
fn malloc_state() -> (usize, usize) {
    // SAFETY: mallinfo2 only reads malloc's statistics.
    let info = unsafe { libc::mallinfo2() };
    (info.hblkhd, info.fordblks)
}

#[test]
fn large_allocations_come_from_the_heap_and_stay_there() {
    let user_set = std::env::vars().any(|(k, v)| {
        (k == "GLIBC_TUNABLES" && v.contains("glibc.malloc.")) || k.starts_with("MALLOC_")
    });
    if user_set {
        // Settings from the environment would decide instead: check in a
        // run of this test without them.
        let exe = std::env::current_exe().expect("this test's binary");
        let mut again = std::process::Command::new(exe);
        again.args([
            "--exact",
            "large_allocations_come_from_the_heap_and_stay_there",
            "--nocapture",
        ]);
        for (k, _) in std::env::vars() {
            if k == "GLIBC_TUNABLES" || k.starts_with("MALLOC_") {
                again.env_remove(&k);
            }
        }
        let out = again.output().expect("running this test again");
        assert!(
            out.status.success(),
            "without the environment's malloc settings: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        return;
    }
    const MIB: usize = 1 << 20;
    // glibc's default: a 4 MiB block gets a mapping of its own.
    let (mapped, _) = malloc_state();
    let first = std::hint::black_box(vec![1u8; 4 * MIB]);
    assert!(malloc_state().0 >= mapped + 4 * MIB, "the default changed");
    drop(first);

    stoke_worker::cli::keep_freed_memory();
    let (mapped, _) = malloc_state();
    let block = std::hint::black_box(vec![1u8; 16 * MIB]);
    assert_eq!(malloc_state().0, mapped, "16 MiB got a mapping of its own");
    drop(block);
    // Freed, it stays in the heap for the next batch.
    assert!(malloc_state().1 >= 16 * MIB, "the heap was trimmed");
}
