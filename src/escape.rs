//! Untrusted strings on their way into a log line: quoted, escaped and cut
//! short, so that no client can forge a line (a newline), move the terminal
//! (ESC, CR), reorder what an administrator reads (bidi overrides), or make
//! loopd write more than a few hundred bytes per mention (a 64 KiB export
//! name). Pure; imports nothing of loopd.

use std::fmt::Write;

/// Characters of an untrusted string shown in a log line; the rest is cut
/// and its length in bytes given instead.
pub const SHOWN: usize = 64;

/// `s` (bytes from a client: UTF-8 or not) as it may appear in a log line:
/// in double quotes; `"` and `\` escaped; letters and digits of any script,
/// ASCII punctuation and the space as they are; every other character
/// (controls, format and bidi characters, marks, symbols outside ASCII) as
/// `\u{…}`, `\n`, `\r`, `\t`; bytes that are not UTF-8 as `\xNN`. At most
/// `max` characters are shown: a longer string ends in `…"` followed by its
/// length, e.g. `"aaaa…" (4096 bytes)`. The result is at most `12 * max + 30`
/// bytes long, whatever `s` is.
pub fn clip(s: &[u8], max: usize) -> String {
    let mut out = String::with_capacity(s.len().min(max) + 2);
    out.push('"');
    let mut shown = 0;
    let mut cut = false;
    'chunks: for chunk in s.utf8_chunks() {
        for c in chunk.valid().chars() {
            if shown == max {
                cut = true;
                break 'chunks;
            }
            shown += 1;
            push_char(&mut out, c);
        }
        for b in chunk.invalid() {
            if shown == max {
                cut = true;
                break 'chunks;
            }
            shown += 1;
            let _ = write!(out, "\\x{b:02x}");
        }
    }
    if cut {
        let _ = write!(out, "…\" ({} bytes)", s.len());
    } else {
        out.push('"');
    }
    out
}

/// [`clip`] with the usual length, [`SHOWN`].
pub fn untrusted(s: &str) -> String {
    clip(s.as_bytes(), SHOWN)
}

fn push_char(out: &mut String, c: char) {
    match c {
        '"' => out.push_str("\\\""),
        '\\' => out.push_str("\\\\"),
        '\n' => out.push_str("\\n"),
        '\r' => out.push_str("\\r"),
        '\t' => out.push_str("\\t"),
        ' ' => out.push(' '),
        c if c.is_ascii_graphic() => out.push(c),
        c if !c.is_ascii() && c.is_alphanumeric() => out.push(c),
        c => {
            let _ = write!(out, "\\u{{{:x}}}", u32::from(c));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn plain_names_are_quoted_as_they_are() {
        assert_eq!(clip(b"disk-1.img", 64), "\"disk-1.img\"");
        assert_eq!(untrusted("Übung 7"), "\"Übung 7\"");
        assert_eq!(clip(b"", 64), "\"\"");
    }

    #[test]
    fn line_breaks_terminal_and_bidi_controls_are_escaped() {
        assert_eq!(
            untrusted("a\nb\r\u{1b}[2J\"\\\u{202e}x"),
            "\"a\\nb\\r\\u{1b}[2J\\\"\\\\\\u{202e}x\""
        );
        assert_eq!(clip(b"\xff\xfeok", 64), "\"\\xff\\xfeok\"");
    }

    #[test]
    fn long_strings_are_cut_with_their_length() {
        let name = "a".repeat(4096);
        assert_eq!(
            untrusted(&name),
            format!("\"{}…\" (4096 bytes)", "a".repeat(64))
        );
        assert_eq!(clip(b"abc", 3), "\"abc\"");
        assert_eq!(clip(b"abcd", 3), "\"abc…\" (4 bytes)");
    }

    proptest! {
        #[test]
        fn output_is_one_bounded_printable_line(s in proptest::collection::vec(any::<u8>(), 0..600),
                                                max in 0usize..100) {
            let out = clip(&s, max);
            prop_assert!(out.len() <= 12 * max + 30, "{} bytes: {out}", out.len());
            prop_assert!(out.starts_with('"'));
            for c in out.chars() {
                prop_assert!(!c.is_control(), "control {c:?} in {out:?}");
                prop_assert!(c.is_ascii() || c.is_alphanumeric() || c == '…', "{c:?} in {out:?}");
            }
        }

        #[test]
        fn short_utf8_round_trips_through_the_escapes(s in "[a-zA-Z0-9 ._/-]{0,64}") {
            prop_assert_eq!(clip(s.as_bytes(), 64), format!("\"{s}\""));
        }
    }
}
