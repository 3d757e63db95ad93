//! Strings: found whole within a piece, or resumed across pieces, and counted.

use super::search::find_quote_or_backslash;
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
