//! What the benchmarks that report memory read: the process's data segment.

/// The process's data segment in bytes (`VmData` in `/proc/self/status`, Linux only; 0
/// elsewhere): the crate forbids `unsafe` code, benches included, so no counting allocator is
/// possible. Heap growth comes in whole pages; over 10,000 items that rounding is below a
/// byte each, and the figure includes the allocator's own overhead per allocation.
pub(crate) fn data_segment() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmData:"))
        .and_then(|rest| {
            rest.trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<usize>()
                .ok()
        })
        .map_or(0, |kb| kb * 1_024)
}
