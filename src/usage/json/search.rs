//! Finding the end of a JSON string: a pure byte search, eight bytes at a time.

/// The index of the `"` that closes the string whose text starts at `bytes[from]`, if it is
/// in `bytes`.
#[inline]
pub(super) fn string_end(bytes: &[u8], mut from: usize) -> Option<usize> {
    loop {
        let at = from + find_quote_or_backslash(bytes.get(from..)?)?;
        if bytes[at] == b'"' {
            return Some(at);
        }
        // Skip the escaped byte.
        from = at + 2;
    }
}

/// The index of the first `"` or `\` in `bytes`: eight bytes at a time (SWAR) over the first
/// 32 bytes, where most keys and short values end, then `memchr`.
#[inline]
pub(super) fn find_quote_or_backslash(bytes: &[u8]) -> Option<usize> {
    const ONES: u64 = u64::from_le_bytes([1; 8]);
    const HIGH: u64 = ONES << 7;
    /// The high bit of each byte of `word` that is zero (above the first, maybe more).
    fn zeros(word: u64) -> u64 {
        word.wrapping_sub(ONES) & !word & HIGH
    }
    let mut words = bytes.chunks_exact(8);
    for (n, word) in (&mut words).take(4).enumerate() {
        let word = u64::from_le_bytes(word.try_into().unwrap_or_default());
        let found =
            zeros(word ^ (ONES * u64::from(b'"'))) | zeros(word ^ (ONES * u64::from(b'\\')));
        if found != 0 {
            // The lowest flagged byte is exact: a borrow only flags bytes above a zero.
            return Some(n * 8 + found.trailing_zeros() as usize / 8);
        }
    }
    let done = bytes.len() - words.len() * 8 - words.remainder().len();
    if words.len() > 0 {
        return memchr::memchr2(b'"', b'\\', &bytes[done..]).map(|at| done + at);
    }
    let tail = words.remainder();
    let at = tail.iter().position(|&b| b == b'"' || b == b'\\')?;
    Some(done + at)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_quotes_and_backslashes_like_a_plain_loop() {
        let naive = |bytes: &[u8]| bytes.iter().position(|&b| b == b'"' || b == b'\\');
        // Neighbours of `"` (0x22) and `\` (0x5C), and bytes that borrow in SWAR.
        for filler in [0x21, 0x23, 0x5B, 0x5D, 0x00, 0x01, 0xA2, 0xDC, 0xFF] {
            for len in 0..80 {
                let mut bytes = vec![filler; len];
                assert_eq!(find_quote_or_backslash(&bytes), naive(&bytes));
                for at in 0..len {
                    for target in [b'"', b'\\'] {
                        bytes[at] = target;
                        assert_eq!(find_quote_or_backslash(&bytes), Some(at), "{len} {at}");
                        bytes[at] = filler;
                    }
                }
            }
        }
    }
}
