//! Strings: found whole within a piece, or resumed across pieces, and counted.

use super::{Escape, JsonScan, Mode, SHORT, Str, Visit};

impl JsonScan {
    /// A skipped, key or read string resumed at `bytes[i]`; returns where the scan goes on.
    pub(super) fn string<V: Visit>(
        &mut self,
        kind: Str,
        bytes: &[u8],
        mut i: usize,
        visit: &mut V,
    ) -> usize {
        let start = i;
        loop {
            if self.escape == Escape::Backslash {
                if i == bytes.len() {
                    break;
                }
                self.escape = Escape::None;
                i += 1;
            }
            match find_quote_or_backslash(&bytes[i..]) {
                None => break,
                Some(at) if bytes[i + at] == b'\\' => {
                    self.escape = Escape::Backslash;
                    i += at + 1;
                }
                Some(at) => {
                    let end = i + at;
                    self.keep_short(kind, &bytes[start..end]);
                    let short = self.short;
                    self.end_string(kind, short.get(..self.short_len), visit);
                    return end + 1;
                }
            }
        }
        self.keep_short(kind, &bytes[start..]);
        bytes.len()
    }

    fn keep_short(&mut self, kind: Str, bytes: &[u8]) {
        if !matches!(kind, Str::Key | Str::Read) || self.short_len > SHORT {
            return;
        }
        match self
            .short
            .get_mut(self.short_len..self.short_len + bytes.len())
        {
            Some(room) => {
                room.copy_from_slice(bytes);
                self.short_len += bytes.len();
            }
            None => self.short_len = SHORT + 1,
        }
    }

    /// A counted string resumed at `bytes[i]`: counts the characters it encodes (a `\u`
    /// escape is one, a surrogate pair too).
    pub(super) fn counted<V: Visit>(&mut self, bytes: &[u8], mut i: usize, visit: &mut V) -> usize {
        let mut chars = 0u64;
        let mut closed = false;
        while let Some(&b) = bytes.get(i) {
            match self.escape {
                Escape::None => {
                    match b {
                        b'"' => {
                            closed = true;
                            i += 1;
                            break;
                        }
                        b'\\' => self.escape = Escape::Backslash,
                        // Every byte but UTF-8 continuation bytes starts a character.
                        _ => chars += u64::from(b & 0xC0 != 0x80),
                    }
                    i += 1;
                }
                Escape::Backslash => {
                    self.escape = if b == b'u' {
                        Escape::Hex {
                            digits: 0,
                            value: 0,
                        }
                    } else {
                        chars += 1;
                        Escape::None
                    };
                    i += 1;
                }
                Escape::Hex { digits, value } => match (b as char).to_digit(16) {
                    Some(digit) => {
                        let value = (value << 4) | digit as u16;
                        self.escape = if digits == 3 {
                            // A low surrogate ends a pair already counted.
                            chars += u64::from(!(0xDC00..=0xDFFF).contains(&value));
                            Escape::None
                        } else {
                            Escape::Hex {
                                digits: digits + 1,
                                value,
                            }
                        };
                        i += 1;
                    }
                    None => {
                        // A malformed escape: count it, and scan `b` again as text.
                        chars += 1;
                        self.escape = Escape::None;
                    }
                },
            }
        }
        if chars > 0 {
            visit.chars(&self.path[..self.depth], chars);
        }
        if closed {
            self.mode = Mode::Open;
        }
        i
    }
}

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
fn find_quote_or_backslash(bytes: &[u8]) -> Option<usize> {
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
