//! A resumable JSON scanner: it walks a document fed in pieces of any size, knows at every
//! byte where in the document it is, and reports only what a [`Visit`] asks for.
//!
//! It keeps a fixed amount of state: the path of open containers (as small ids the visitor
//! gives to the keys it cares about), a short buffer for a key cut by the end of a piece, and
//! at most [`MAX_CAPTURE`] bytes of one captured object. Strings are skipped without being
//! copied; containers deeper than [`MAX_DEPTH`] are skipped whole.
//!
//! It is not a validator, and looks at as few bytes as it can: outside strings only the seven
//! structural bytes `"` `:` `,` `{` `}` `[` `]` matter (numbers, literals and whitespace are
//! skipped unread); a string is a key if it comes first in an object or after a `,` there, a
//! value otherwise. A closing bracket that does not match stops the scan; whatever was
//! reported before stays reported. A captured object is for the visitor to validate.
//!
//! # Length
//!
//! The scanner's structural state machine is one `match` over its modes; strings (found whole
//! or resumed across pieces) are in `strings.rs`, the byte search in `search.rs`.

/// Nesting levels whose path is tracked; containers deeper than this are skipped whole.
pub(super) const MAX_DEPTH: usize = 8;
/// The largest object captured for a [`Visit`]; a bigger one is dropped.
pub(super) const MAX_CAPTURE: usize = 16 * 1024;
/// The longest key or read value kept; a longer one is treated as unknown.
const SHORT: usize = 64;

/// The path segment of a key the visitor does not care about.
pub(super) const OTHER: u8 = 0;
/// The path segment of an array element.
pub(super) const INDEX: u8 = u8::MAX;

/// What to do with a string value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum StringUse {
    /// Skip it.
    Skip,
    /// Count its characters, reported with [`Visit::chars`].
    Count,
    /// Read it, reported with [`Visit::read`] if it is at most 64 bytes long.
    Read,
}

/// What a scan reports to, and asks of. Paths are the segments of the open containers from the
/// root record down: a key's id (from [`Visit::key`]) or [`INDEX`].
pub(super) trait Visit {
    /// The id of `key` (raw, escapes undecoded) in the object at `parent`: [`OTHER`] for a key
    /// of no interest, never [`INDEX`].
    fn key(&self, parent: &[u8], key: &[u8]) -> u8;
    /// What to do with a string value at `path`.
    fn string(&self, path: &[u8]) -> StringUse;
    /// Whether to capture the object value at `path`.
    fn capture(&self, path: &[u8]) -> bool;
    /// `chars` more characters of a counted string at `path` (called per piece).
    fn chars(&mut self, path: &[u8], chars: u64);
    /// A read string at `path`, raw.
    fn read(&mut self, path: &[u8], value: &[u8]);
    /// A captured object at `path`, from `{` to `}`, if it was at most [`MAX_CAPTURE`] bytes.
    fn captured(&mut self, path: &[u8], object: &[u8]);
    /// A record starts: the root object, or an object element of a root array.
    fn record_start(&mut self);
    /// The record closed.
    fn record_end(&mut self);
}

/// Where the scan is, between bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Before the root value.
    Start,
    /// In the root value, outside strings.
    Open,
    /// Inside a string.
    Str(Str),
    /// Inside a container skipped whole, [`JsonScan::deep`] levels down.
    Deep,
    /// The root value ended; the rest is ignored.
    Done,
    /// The structure broke; the rest is ignored.
    Failed,
}

/// What the string being scanned is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Str {
    Key,
    Skip,
    Count,
    Read,
    /// A string inside a skipped container.
    Deep,
}

/// An escape sequence cut by the end of a piece, or in progress in a counted string.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Escape {
    None,
    /// After a `\`.
    Backslash,
    /// In the hex digits of a `\u` escape (counted strings only).
    Hex {
        digits: u8,
        value: u16,
    },
}

mod search;
mod strings;

use search::string_end;

/// The bytes that matter outside strings.
const STRUCTURAL: [bool; 256] = {
    let mut table = [false; 256];
    let mut i = 0;
    while i < 7 {
        table[b"\":,{}[]"[i] as usize] = true;
        i += 1;
    }
    table
};

/// The scanner; see the [module documentation](self).
#[derive(Debug, Clone)]
pub(super) struct JsonScan {
    mode: Mode,
    escape: Escape,
    /// The next string in the current object is a key.
    expect_key: bool,
    /// The segments of the open containers; `path[..depth]` is the current path.
    path: [u8; MAX_DEPTH],
    depth: usize,
    /// Open containers inside a container skipped whole (at least 1 in [`Mode::Deep`]).
    deep: u64,
    /// The root is an array, whose object elements are records.
    array_root: bool,
    /// The key or read value so far, when cut by the end of a piece; `short_len > SHORT`
    /// means too long.
    short: [u8; SHORT],
    short_len: usize,
    /// The level of the object being captured.
    capture_level: Option<usize>,
    /// Its bytes so far; empty after it got too large.
    capture: Vec<u8>,
    capture_overflow: bool,
    /// Where the capture resumes in the piece being fed.
    capture_from: usize,
}

impl JsonScan {
    pub(super) fn new() -> Self {
        Self {
            mode: Mode::Start,
            escape: Escape::None,
            expect_key: false,
            path: [OTHER; MAX_DEPTH],
            depth: 0,
            deep: 0,
            array_root: false,
            short: [0; SHORT],
            short_len: 0,
            capture_level: None,
            capture: Vec::new(),
            capture_overflow: false,
            capture_from: 0,
        }
    }

    /// Forgets the document, ready for the next one. Keeps the capture buffer's allocation.
    pub(super) fn reset(&mut self) {
        let mut capture = std::mem::take(&mut self.capture);
        capture.clear();
        *self = Self {
            capture,
            ..Self::new()
        };
    }

    /// Scans the next piece of the document.
    pub(super) fn feed<V: Visit>(&mut self, bytes: &[u8], visit: &mut V) {
        self.capture_from = 0;
        let mut i = 0;
        while i < bytes.len() {
            i = match self.mode {
                Mode::Open => self.open(bytes, i, visit),
                Mode::Str(Str::Count) => self.counted(bytes, i, visit),
                Mode::Str(kind) => self.string(kind, bytes, i, visit),
                Mode::Deep => self.skip_deep(bytes, i),
                Mode::Start => self.start(bytes, i, visit),
                Mode::Done | Mode::Failed => bytes.len(),
            };
        }
        if self.capture_level.is_some() {
            self.keep_captured(bytes.get(self.capture_from..).unwrap_or_default());
        }
    }

    /// Before the root, from `bytes[i]`: whitespace, then `{` or `[`.
    fn start<V: Visit>(&mut self, bytes: &[u8], i: usize, visit: &mut V) -> usize {
        match bytes[i] {
            b' ' | b'\t' | b'\n' | b'\r' => {}
            b'{' => {
                self.mode = Mode::Open;
                self.open_object(i, visit);
            }
            b'[' => {
                self.mode = Mode::Open;
                self.array_root = true;
            }
            _ => self.fail(),
        }
        i + 1
    }

    /// The hot path, from `bytes[i]` in the root value and outside strings: skips to each
    /// structural byte, and takes strings that end within `bytes` in one step without a copy.
    /// Returns where a string cut by the end of `bytes` (or a counted string) starts, or where
    /// the mode changed.
    fn open<V: Visit>(&mut self, bytes: &[u8], mut i: usize, visit: &mut V) -> usize {
        loop {
            while bytes.get(i).is_some_and(|&b| !STRUCTURAL[usize::from(b)]) {
                i += 1;
            }
            let Some(&b) = bytes.get(i) else {
                return i;
            };
            i += 1;
            match b {
                b'"' => {
                    let kind = self.string_kind(visit);
                    let end = match kind {
                        Str::Count => None,
                        _ => string_end(bytes, i),
                    };
                    let Some(end) = end else {
                        self.short_len = 0;
                        self.mode = Mode::Str(kind);
                        return i;
                    };
                    self.end_string(kind, Some(&bytes[i..end]), visit);
                    i = end + 1;
                    continue;
                }
                b':' => {
                    self.expect_key = false;
                    continue;
                }
                b',' => {
                    self.expect_key = self.depth > 0 && self.path[self.depth - 1] != INDEX;
                    continue;
                }
                b'{' => self.open_object(i - 1, visit),
                b'[' => self.open_array(),
                _ => self.close(b, bytes, i - 1, visit),
            }
            // Brackets may go deep, end the document or break it.
            if self.mode != Mode::Open {
                return i;
            }
        }
    }

    /// What the string starting here is.
    fn string_kind<V: Visit>(&self, visit: &V) -> Str {
        if self.expect_key {
            Str::Key
        } else if self.depth == 0 {
            // An element of a root array that is not a record.
            Str::Skip
        } else {
            match visit.string(&self.path[..self.depth]) {
                StringUse::Skip => Str::Skip,
                StringUse::Count => Str::Count,
                StringUse::Read => Str::Read,
            }
        }
    }

    /// `{` at `bytes[i]`.
    fn open_object<V: Visit>(&mut self, i: usize, visit: &mut V) {
        if self.depth == MAX_DEPTH {
            return self.open_deep();
        }
        if self.depth == 0 {
            visit.record_start();
        } else if self.capture_level.is_none() && visit.capture(&self.path[..self.depth]) {
            self.capture_level = Some(self.depth);
            self.capture_from = i;
            self.capture.clear();
            self.capture_overflow = false;
        }
        self.path[self.depth] = OTHER;
        self.depth += 1;
        self.expect_key = true;
    }

    fn open_array(&mut self) {
        if self.depth == MAX_DEPTH || (self.depth == 0 && self.array_root) {
            // Too deep, or an array in a root array: no records in it.
            return self.open_deep();
        }
        self.path[self.depth] = INDEX;
        self.depth += 1;
        self.expect_key = false;
    }

    /// Skips a container whole.
    fn open_deep(&mut self) {
        self.deep = 1;
        self.mode = Mode::Deep;
    }

    /// `b` (`}` or `]`) at `bytes[i]` closes the innermost container.
    fn close<V: Visit>(&mut self, b: u8, bytes: &[u8], i: usize, visit: &mut V) {
        self.expect_key = false;
        let Some(level) = self.depth.checked_sub(1) else {
            // Only a root array closes at depth 0.
            if self.array_root && b == b']' {
                self.mode = Mode::Done;
            } else {
                self.fail();
            }
            return;
        };
        if (self.path[level] == INDEX) != (b == b']') {
            return self.fail();
        }
        self.depth = level;
        if self.capture_level == Some(level) {
            self.capture_level = None;
            self.keep_captured(bytes.get(self.capture_from..=i).unwrap_or_default());
            if !self.capture_overflow {
                visit.captured(&self.path[..level], &self.capture);
            }
            self.capture.clear();
        }
        if level == 0 {
            visit.record_end();
            if !self.array_root {
                self.mode = Mode::Done;
            }
        }
    }

    fn fail(&mut self) {
        self.mode = Mode::Failed;
        self.capture_level = None;
        self.capture.clear();
    }

    fn keep_captured(&mut self, bytes: &[u8]) {
        if self.capture_overflow {
            return;
        }
        if self.capture.len().saturating_add(bytes.len()) > MAX_CAPTURE {
            self.capture_overflow = true;
            self.capture = Vec::new();
        } else {
            self.capture.extend_from_slice(bytes);
        }
    }

    /// A string of `kind` ended; `text` is its raw text (when known: keys and read values).
    #[inline]
    fn end_string<V: Visit>(&mut self, kind: Str, text: Option<&[u8]>, visit: &mut V) {
        let text = text.filter(|s| s.len() <= SHORT);
        self.mode = match kind {
            Str::Key => {
                let level = self.depth.saturating_sub(1);
                let id = match text {
                    Some(key) => visit.key(&self.path[..level], key).min(INDEX - 1),
                    None => OTHER,
                };
                self.path[level] = id;
                self.expect_key = false;
                Mode::Open
            }
            Str::Read => {
                if let Some(value) = text {
                    visit.read(&self.path[..self.depth], value);
                }
                Mode::Open
            }
            Str::Deep => Mode::Deep,
            Str::Skip | Str::Count => Mode::Open,
        };
    }

    /// Inside a container skipped whole, from `bytes[i]`.
    fn skip_deep(&mut self, bytes: &[u8], mut i: usize) -> usize {
        while let Some(&b) = bytes.get(i) {
            i += 1;
            match b {
                b'"' => {
                    self.short_len = 0;
                    self.mode = Mode::Str(Str::Deep);
                    break;
                }
                b'{' | b'[' => self.deep = self.deep.saturating_add(1),
                b'}' | b']' => {
                    self.deep = self.deep.saturating_sub(1);
                    if self.deep == 0 {
                        self.mode = Mode::Open;
                        self.expect_key = false;
                        break;
                    }
                }
                _ => {}
            }
        }
        i
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keys `usage` (1) and `text` (2) anywhere; counts strings under `text`, reads strings
    /// under `type`, captures objects under `usage`, and logs everything.
    #[derive(Default)]
    struct Log {
        chars: u64,
        read: Vec<String>,
        captured: Vec<(Vec<u8>, String)>,
        records: (u32, u32),
    }

    impl Visit for Log {
        fn key(&self, _parent: &[u8], key: &[u8]) -> u8 {
            match key {
                b"usage" => 1,
                b"text" => 2,
                b"type" => 3,
                _ => OTHER,
            }
        }
        fn string(&self, path: &[u8]) -> StringUse {
            match path.last() {
                Some(2) => StringUse::Count,
                Some(3) => StringUse::Read,
                _ => StringUse::Skip,
            }
        }
        fn capture(&self, path: &[u8]) -> bool {
            path.last() == Some(&1)
        }
        fn chars(&mut self, _path: &[u8], chars: u64) {
            self.chars += chars;
        }
        fn read(&mut self, _path: &[u8], value: &[u8]) {
            self.read.push(String::from_utf8_lossy(value).into_owned());
        }
        fn captured(&mut self, path: &[u8], object: &[u8]) {
            let object = String::from_utf8_lossy(object).into_owned();
            self.captured.push((path.to_vec(), object));
        }
        fn record_start(&mut self) {
            self.records.0 += 1;
        }
        fn record_end(&mut self) {
            self.records.1 += 1;
        }
    }

    /// Scans `json` whole and byte by byte, checks both agree, and returns the log and mode.
    fn scan(json: &str) -> (Log, Mode) {
        let mut whole = (JsonScan::new(), Log::default());
        whole.0.feed(json.as_bytes(), &mut whole.1);
        let mut bytes = (JsonScan::new(), Log::default());
        for b in json.as_bytes() {
            bytes.0.feed(std::slice::from_ref(b), &mut bytes.1);
        }
        assert_eq!(whole.0.mode, bytes.0.mode, "{json}");
        assert_eq!(whole.1.chars, bytes.1.chars, "{json}");
        assert_eq!(whole.1.read, bytes.1.read, "{json}");
        assert_eq!(whole.1.captured, bytes.1.captured, "{json}");
        (whole.1, whole.0.mode)
    }

    #[test]
    fn captures_objects_at_their_path_only() {
        let (log, mode) = scan(
            r#"{"a": {"usage": {"x": 1}}, "usage" : { "in": [1, {"b": "}"}], "s": "\"{" } , "z": null}"#,
        );
        assert_eq!(mode, Mode::Done);
        assert_eq!(
            log.captured,
            [
                (vec![OTHER, 1], r#"{"x": 1}"#.to_owned()),
                (
                    vec![1],
                    r#"{ "in": [1, {"b": "}"}], "s": "\"{" }"#.to_owned()
                ),
            ]
        );
        assert_eq!(log.records, (1, 1));
    }

    #[test]
    fn counts_characters_with_escapes_and_utf8() {
        let (log, _) = scan(r#"{"text": "h\u00e9llo \"w\" \ud83d\ude00 é😀\n", "other": "xx"}"#);
        // h é l l o ␠ " w " ␠ 😀 ␠ é 😀 ⏎
        assert_eq!(log.chars, 15);
        let (log, _) = scan(r#"{"text": "\u12"}"#);
        assert_eq!(
            log.chars, 1,
            "malformed escapes count and do not swallow the quote"
        );
    }

    #[test]
    fn reads_short_strings_and_skips_long_ones() {
        let long = "t".repeat(SHORT + 1);
        let json =
            format!(r#"{{"type": "message_delta", "x": {{"type": "a\"b"}}, "type": "{long}"}}"#);
        let (log, _) = scan(&json);
        assert_eq!(log.read, ["message_delta", r#"a\"b"#]);
    }

    #[test]
    fn root_arrays_hold_records() {
        let (log, mode) =
            scan(r#"[{"usage": {"a": 1}}, 3, "s", [[{"usage": {}}]], {"usage": {"a": 2}}]"#);
        assert_eq!(mode, Mode::Done);
        assert_eq!(log.records, (2, 2));
        let objects: Vec<_> = log.captured.iter().map(|(_, o)| o.as_str()).collect();
        assert_eq!(objects, [r#"{"a": 1}"#, r#"{"a": 2}"#]);
    }

    #[test]
    fn deep_containers_are_skipped_whole() {
        let nested = "[".repeat(40) + r#"{"usage": {}, "text": "abc"}"# + &"]".repeat(40);
        let json = format!(r#"{{"deep": {nested}, "text": "de", "usage": {{"ok": true}}}}"#);
        let (log, mode) = scan(&json);
        assert_eq!(mode, Mode::Done);
        assert_eq!(log.chars, 2);
        assert_eq!(log.captured.len(), 1);
    }

    #[test]
    fn broken_structure_stops_the_scan() {
        for json in [
            r#"{"usage": {"a": 1]}"#,
            r#"{"a" 1}"#,
            r#"{"a": }"#,
            r#"}"#,
            r#"{"a": 1}}"#,
            "data: {}",
        ] {
            let (log, mode) = scan(json);
            assert!(matches!(mode, Mode::Failed | Mode::Done), "{json}");
            assert!(log.captured.is_empty(), "{json}");
        }
        let (_, mode) = scan(r#"{"a": 1} trailing"#);
        assert_eq!(mode, Mode::Done, "the rest after the root is ignored");
    }

    #[test]
    fn oversized_captures_are_dropped() {
        let big = format!(
            r#"{{"usage": {{"pad": "{}"}}, "text": "ab"}}"#,
            "x".repeat(MAX_CAPTURE)
        );
        let (log, mode) = scan(&big);
        assert_eq!(mode, Mode::Done);
        assert!(log.captured.is_empty());
        assert_eq!(log.chars, 2);
        let fits = format!(
            r#"{{"usage": {{"pad": "{}"}}}}"#,
            "x".repeat(MAX_CAPTURE - 20)
        );
        assert_eq!(scan(&fits).0.captured.len(), 1);
    }

    #[test]
    fn reset_starts_a_new_document() {
        let mut scan = JsonScan::new();
        let mut log = Log::default();
        scan.feed(br#"{"usage": {"a": "#, &mut log);
        scan.reset();
        scan.feed(br#"{"usage": {"b": 2}}"#, &mut log);
        assert_eq!(log.captured, [(vec![1], r#"{"b": 2}"#.to_owned())]);
    }
}
