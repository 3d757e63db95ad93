//! Server-sent events framing (the WHATWG `text/event-stream` format), incrementally: the
//! values of an event's `data` lines go to a [`Sink`] as they arrive, joined with `\n`, and the
//! blank line that ends the event dispatches it. Nothing is buffered: the state between two
//! pieces is a few bytes.

/// Where the values of `data` lines go.
pub(super) trait Sink {
    /// More of the current event's data.
    fn data(&mut self, bytes: &[u8]);
    /// The current event ended (a blank line after at least one `data` line).
    fn dispatch(&mut self);
}

/// Where a line is, between bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Line {
    /// At the start of a line, or `n` bytes into a field name that so far matches `data`.
    Name(u8),
    /// Right after `data:`, where one space is dropped.
    Colon,
    /// In the value of a `data` line.
    Data,
    /// In any other line: a comment, `event`, `id`, `retry`, an unknown field.
    Skip,
}

/// The framing state; see the [module documentation](self).
#[derive(Debug, Clone)]
pub(super) struct EventStream {
    line: Line,
    /// The previous piece ended with `\r`: a `\n` starting this one ends no second line.
    after_cr: bool,
    /// The current event has had a `data` line.
    has_data: bool,
}

impl EventStream {
    pub(super) fn new() -> Self {
        Self {
            line: Line::Name(0),
            after_cr: false,
            has_data: false,
        }
    }

    /// Frames the next piece of the stream.
    pub(super) fn feed(&mut self, bytes: &[u8], sink: &mut impl Sink) {
        let mut i = 0;
        if self.after_cr && !bytes.is_empty() {
            self.after_cr = false;
            i += usize::from(bytes[0] == b'\n');
        }
        while let Some(&b) = bytes.get(i) {
            match self.line {
                Line::Data | Line::Skip => {
                    let rest = &bytes[i..];
                    let end = find_line_end(rest);
                    if self.line == Line::Data {
                        sink.data(&rest[..end.unwrap_or(rest.len())]);
                    }
                    match end {
                        Some(end) => i = self.end_line(bytes, i + end),
                        None => return,
                    }
                }
                Line::Colon if b == b' ' => {
                    self.line = Line::Data;
                    i += 1;
                }
                Line::Colon => self.line = Line::Data,
                // The usual line, its field name whole in this piece: one step.
                Line::Name(0) if bytes[i..].starts_with(b"data:") => {
                    self.start_data(sink);
                    self.line = Line::Colon;
                    i += 5;
                }
                Line::Name(n) => match b {
                    b'\r' | b'\n' => {
                        if n == 0 {
                            self.dispatch(sink);
                        } else if n == 4 {
                            // `data` alone: an empty data line.
                            self.start_data(sink);
                        }
                        i = self.end_line(bytes, i);
                    }
                    b':' => {
                        if n == 4 {
                            self.start_data(sink);
                            self.line = Line::Colon;
                        } else {
                            self.line = Line::Skip;
                        }
                        i += 1;
                    }
                    _ => {
                        self.line = match b"data".get(usize::from(n)) {
                            Some(&expected) if expected == b => Line::Name(n + 1),
                            _ => Line::Skip,
                        };
                        i += 1;
                    }
                },
            }
        }
    }

    fn start_data(&mut self, sink: &mut impl Sink) {
        if self.has_data {
            sink.data(b"\n");
        }
        self.has_data = true;
    }

    fn dispatch(&mut self, sink: &mut impl Sink) {
        if self.has_data {
            self.has_data = false;
            sink.dispatch();
        }
    }

    /// The line ends at `bytes[at]` (`\r` or `\n`); returns the index after its end.
    fn end_line(&mut self, bytes: &[u8], at: usize) -> usize {
        self.line = Line::Name(0);
        if bytes[at] == b'\n' {
            return at + 1;
        }
        match bytes.get(at + 1) {
            Some(b'\n') => at + 2,
            Some(_) => at + 1,
            None => {
                self.after_cr = true;
                at + 1
            }
        }
    }
}

/// The index of the first `\n` or `\r` in `bytes`.
#[inline]
fn find_line_end(bytes: &[u8]) -> Option<usize> {
    memchr::memchr2(b'\n', b'\r', bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default)]
    struct Events {
        current: Vec<u8>,
        events: Vec<String>,
    }

    impl Sink for Events {
        fn data(&mut self, bytes: &[u8]) {
            self.current.extend_from_slice(bytes);
        }
        fn dispatch(&mut self) {
            let event = std::mem::take(&mut self.current);
            self.events.push(String::from_utf8(event).unwrap());
        }
    }

    /// The events of `stream`, fed whole and byte by byte (which must agree).
    fn events(stream: &str) -> Vec<String> {
        let mut whole = Events::default();
        EventStream::new().feed(stream.as_bytes(), &mut whole);
        let mut bytes = Events::default();
        let mut framing = EventStream::new();
        for b in stream.as_bytes() {
            framing.feed(std::slice::from_ref(b), &mut bytes);
        }
        assert_eq!(whole.events, bytes.events, "{stream:?}");
        whole.events
    }

    #[test]
    fn events_end_at_blank_lines_with_any_line_ending() {
        for eol in ["\n", "\r\n", "\r"] {
            let stream =
                "event: a\ndata: {\"x\":1}\n\n: comment\n\ndata:[DONE]\n\n".replace('\n', eol);
            assert_eq!(events(&stream), ["{\"x\":1}", "[DONE]"], "{eol:?}");
        }
    }

    #[test]
    fn data_lines_join_with_newlines() {
        let stream = "data: a\ndata\ndata:  b\nid: 7\ndata: c\n\n";
        assert_eq!(events(stream), ["a\n\n b\nc"]);
    }

    #[test]
    fn other_fields_and_unfinished_events_are_ignored() {
        let stream = "dat: x\ndatas: y\nevent: data\nretry: 10\n\ndata: tail";
        assert!(events(stream).is_empty());
        // A `\r` then `\n` across pieces is one line end, not an empty line.
        let mut sink = Events::default();
        let mut framing = EventStream::new();
        framing.feed(b"data: a\r", &mut sink);
        framing.feed(b"\ndata: b\r\n\r\n", &mut sink);
        assert_eq!(sink.events, ["a\nb"]);
    }
}
