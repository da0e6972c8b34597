//! Untrusted strings (image paths, device and export names, peer-supplied
//! bytes) made safe for a log line or a terminal.
//!
//! Contract: what [`quoted`], [`quoted_path`] and [`escape`] print is one line
//! with no control character (C0, DEL, C1), no line or paragraph separator,
//! no bidirectional override or isolate (U+202A–U+202E, U+2066–U+2069), no
//! other format or invisible character (zero-width spaces and joiners, BOM,
//! soft hyphen, tag characters, Hangul fillers) and no whitespace but the
//! ASCII space: each of those is written as a Rust escape (`\n`, `\r`, `\t`,
//! `\0`, `\u{202e}`), a backslash as `\\`, and a byte that is not UTF-8 (in a
//! path) as `\xNN`. So the output is unambiguous: [`quoted`] is a Rust string
//! literal that reads back as the original. [`sanitize_line`] is the sink's
//! last line of defence (the log writer runs every line through it): it
//! escapes the same characters but leaves backslashes alone, so text that was
//! already quoted passes unchanged.
//!
//! [`error_chain`] and [`join_causes`] are the one rule for printing an
//! error with its causes: `outer: cause: cause`, each cause once (a cause
//! whose text the line already holds is left out).
//!
//! [`natural_cmp`] is the one order of names shown to people: runs of digits
//! compare as numbers (`new1 new2 new10`, not `new1 new10 new2`).
//!
//! Pure, allocation only when something must be escaped; imports nothing of
//! loopd, so every layer may use it.

use std::borrow::Cow;
use std::fmt::{self, Write};
use std::path::Path;

/// Characters Rust's own `Debug` prints as they are but that show nothing, or
/// look like a space, on a terminal (Unicode letters of category Lo).
const INVISIBLE_LETTERS: [char; 5] = [
    '\u{115F}', // HANGUL CHOSEONG FILLER
    '\u{1160}', // HANGUL JUNGSEONG FILLER
    '\u{3164}', // HANGUL FILLER
    '\u{FFA0}', // HALFWIDTH HANGUL FILLER
    '\u{2800}', // BRAILLE PATTERN BLANK
];

/// Whether `c` is written as an escape. `first`: it would follow the opening
/// quote, where a combining mark would decorate the quote itself.
pub fn must_escape(c: char, first: bool) -> bool {
    if c.is_ascii() {
        return c.is_ascii_control();
    }
    if INVISIBLE_LETTERS.contains(&c) || c.is_whitespace() || c.is_control() {
        return true;
    }
    // Rust's Debug knows Unicode's categories: it escapes control, format
    // (bidi controls, zero-width characters, BOM, tags), separator,
    // private-use and unassigned characters, and combining marks (always at
    // the start of a string). Ask it, with a letter in front unless `first`.
    let mut probe = String::with_capacity(8);
    if !first {
        probe.push('a');
    }
    probe.push(c);
    let mut shown = String::with_capacity(16);
    let _ = write!(shown, "{probe:?}");
    shown.contains('\\')
}

/// Write `s` escaped to `w`. `quote`: also escape `"`. `backslash`: also
/// escape `\` (off only for [`sanitize_line`]).
fn write_escaped(
    w: &mut impl Write,
    s: &str,
    quote: bool,
    backslash: bool,
    mut first: bool,
) -> fmt::Result {
    let mut start = 0;
    for (i, c) in s.char_indices() {
        let esc: Option<&str> = match c {
            '\\' if backslash => Some("\\\\"),
            '"' if quote => Some("\\\""),
            '\n' => Some("\\n"),
            '\r' => Some("\\r"),
            '\t' => Some("\\t"),
            '\0' => Some("\\0"),
            _ => None,
        };
        let special = esc.is_some() || must_escape(c, first);
        first = false;
        if !special {
            continue;
        }
        w.write_str(&s[start..i])?;
        match esc {
            Some(e) => w.write_str(e)?,
            None => write!(w, "\\u{{{:x}}}", u32::from(c))?,
        }
        start = i + c.len_utf8();
    }
    w.write_str(&s[start..])
}

/// Whether `s` has nothing to escape (`backslash`: counting `\`).
fn clean(s: &str, backslash: bool) -> bool {
    // Fast path: printable ASCII.
    if s.bytes()
        .all(|b| (0x20..0x7f).contains(&b) && (b != b'\\' || !backslash))
    {
        return true;
    }
    !s.chars()
        .any(|c| (backslash && c == '\\') || must_escape(c, false))
}

/// `s` with every character of the module doc escaped, without quotes: for
/// table cells and `key: value` lines.
pub fn escape(s: &str) -> Cow<'_, str> {
    if clean(s, true) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    let _ = write_escaped(&mut out, s, false, true, false);
    Cow::Owned(out)
}

/// One log line as it may be written: every character of the module doc
/// escaped except `\` (and `"`), so already quoted text is left as it is.
pub fn sanitize_line(s: &str) -> Cow<'_, str> {
    if clean(s, false) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    let _ = write_escaped(&mut out, s, false, false, false);
    Cow::Owned(out)
}

/// `s` in double quotes, escaped (see the module doc): `quoted("a\nb")`
/// displays as `"a\nb"`.
pub fn quoted(s: &str) -> Quoted<'_> {
    Quoted(s.as_bytes())
}

/// A path in double quotes, escaped; bytes that are not UTF-8 as `\xNN`.
pub fn quoted_path(p: &Path) -> Quoted<'_> {
    Quoted(p.as_os_str().as_encoded_bytes())
}

/// Bytes in double quotes, escaped; bytes that are not UTF-8 as `\xNN`.
pub fn quoted_bytes(b: &[u8]) -> Quoted<'_> {
    Quoted(b)
}

/// What [`quoted`], [`quoted_path`] and [`quoted_bytes`] return: displays as
/// a Rust string literal.
#[derive(Clone, Copy)]
pub struct Quoted<'a>(&'a [u8]);

impl fmt::Display for Quoted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_char('"')?;
        let mut first = true;
        for chunk in self.0.utf8_chunks() {
            write_escaped(f, chunk.valid(), true, true, first)?;
            first = first && chunk.valid().is_empty();
            for b in chunk.invalid() {
                write!(f, "\\x{b:02x}")?;
                first = false;
            }
        }
        f.write_char('"')
    }
}

impl fmt::Debug for Quoted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// Characters of an untrusted string a log line shows ([`untrusted`]); the
/// rest is cut and its length in bytes given instead.
pub const SHOWN: usize = 64;

/// `s` (bytes from a client: UTF-8 or not) as a log line may show it: quoted
/// and escaped as [`quoted_bytes`] does, and cut after `max` characters (a byte
/// that is not UTF-8 counts as one), a longer string ending in `…"` followed by
/// its length: `"aaaa…" (4096 bytes)`. So no client makes one mention longer
/// than `10 * max + 30` bytes, whatever it sends.
pub fn clip(s: &[u8], max: usize) -> String {
    let mut end = 0;
    let mut shown = 0;
    'chunks: for chunk in s.utf8_chunks() {
        for c in chunk.valid().chars() {
            if shown == max {
                break 'chunks;
            }
            shown += 1;
            end += c.len_utf8();
        }
        for _ in chunk.invalid() {
            if shown == max {
                break 'chunks;
            }
            shown += 1;
            end += 1;
        }
    }
    let out = quoted_bytes(&s[..end]).to_string();
    if end == s.len() {
        return out;
    }
    let open = &out[..out.len() - 1];
    format!("{open}…\" ({} bytes)", s.len())
}

/// [`clip`] at the usual length, [`SHOWN`] characters.
pub fn untrusted(s: &str) -> String {
    clip(s.as_bytes(), SHOWN)
}

/// An error and its causes on one line, `outer: cause: cause` (see
/// [`join_causes`]): how loopd prints every error chain — the CLI's error
/// line, a control reply's message, a log line.
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    join_causes(std::iter::successors(Some(e), |e| e.source()).map(|e| e.to_string()))
}

/// Join an error's texts, outermost first, with `: `, each cause once: a
/// cause whose text the line already holds (an error that writes its
/// source into its own text, as `io::Error`'s wrappers and some libraries
/// do) adds nothing and is left out, and so is an empty one.
pub fn join_causes<I: IntoIterator<Item = String>>(causes: I) -> String {
    let mut line = String::new();
    for c in causes {
        let c = c.trim();
        if c.is_empty() || line.contains(c) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(c);
    }
    line
}

/// What a printed error line repeats, if anything: a `: `-separated segment
/// of 8 bytes or more twice (`X: Y: Y`), or a path three times — what
/// [`error_chain`] keeps out of loopd's lines (the tests' check of every
/// printed error).
pub fn repeated_cause(line: &str) -> Option<String> {
    let segs: Vec<&str> = line.split(": ").map(str::trim).collect();
    for (i, a) in segs.iter().enumerate() {
        if a.len() >= 8 && segs[i + 1..].contains(a) {
            return Some(format!("{a:?} twice"));
        }
    }
    for w in line.split([' ', '\'', '"', ':', '(', ')', ',', ';']) {
        if w.starts_with('/') && w.len() > 1 && line.matches(w).count() >= 3 {
            return Some(format!("{w} three times"));
        }
    }
    None
}

/// Names in the order people count: runs of ASCII digits compare as numbers
/// (`new2` before `new10`; on equal values the shorter run, `d1` before
/// `d01`), everything else byte by byte; a total order, equal only for equal
/// strings.
pub fn natural_cmp(a: &str, b: &str) -> std::cmp::Ordering {
    use std::cmp::Ordering;
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let (mut i, mut j) = (0, 0);
    let digits = |s: &[u8], from: usize| {
        s[from..]
            .iter()
            .position(|c| !c.is_ascii_digit())
            .map_or(s.len(), |n| from + n)
    };
    while i < a.len() && j < b.len() {
        if a[i].is_ascii_digit() && b[j].is_ascii_digit() {
            let (ea, eb) = (digits(a, i), digits(b, j));
            let strip = |s: &[u8], from: usize, to: usize| {
                let z = s[from..to].iter().take_while(|&&c| c == b'0').count();
                from + z.min(to - from - 1)
            };
            let (na, nb) = (&a[strip(a, i, ea)..ea], &b[strip(b, j, eb)..eb]);
            let o = na
                .len()
                .cmp(&nb.len())
                .then_with(|| na.cmp(nb))
                .then_with(|| (ea - i).cmp(&(eb - j)));
            if o != Ordering::Equal {
                return o;
            }
            (i, j) = (ea, eb);
        } else {
            if a[i] != b[j] {
                return a[i].cmp(&b[j]);
            }
            i += 1;
            j += 1;
        }
    }
    (a.len() - i).cmp(&(b.len() - j))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn names_sort_as_people_count() {
        let mut v = vec![
            "new10", "new2", "new1", "a", "new01", "b2c10", "b2c9", "new", "10", "9",
        ];
        v.sort_by(|a, b| natural_cmp(a, b));
        assert_eq!(
            v,
            [
                "9", "10", "a", "b2c9", "b2c10", "new", "new1", "new01", "new2", "new10"
            ]
        );
    }

    proptest! {
        /// A total order that agrees with equality.
        #[test]
        fn natural_order_is_total(a in "[a0-2]{0,6}", b in "[a0-2]{0,6}", c in "[a0-2]{0,6}") {
            use std::cmp::Ordering;
            prop_assert_eq!(natural_cmp(&a, &b) == Ordering::Equal, a == b);
            prop_assert_eq!(natural_cmp(&a, &b), natural_cmp(&b, &a).reverse());
            if natural_cmp(&a, &b) != Ordering::Greater && natural_cmp(&b, &c) != Ordering::Greater {
                prop_assert_ne!(natural_cmp(&a, &c), Ordering::Greater);
            }
        }
    }

    /// Reads a [`quoted`] literal back (the inverse, for the tests).
    fn unquote(q: &str) -> Option<Vec<u8>> {
        let inner = q.strip_prefix('"')?.strip_suffix('"')?;
        let mut out = Vec::new();
        let mut it = inner.chars();
        while let Some(c) = it.next() {
            if c == '"' {
                return None;
            }
            if c != '\\' {
                let mut b = [0; 4];
                out.extend_from_slice(c.encode_utf8(&mut b).as_bytes());
                continue;
            }
            match it.next()? {
                'n' => out.push(b'\n'),
                'r' => out.push(b'\r'),
                't' => out.push(b'\t'),
                '0' => out.push(0),
                '\\' => out.push(b'\\'),
                '"' => out.push(b'"'),
                'x' => {
                    let h: String = it.by_ref().take(2).collect();
                    out.push(u8::from_str_radix(&h, 16).ok()?);
                }
                'u' => {
                    if it.next()? != '{' {
                        return None;
                    }
                    let h: String = it.by_ref().take_while(|&c| c != '}').collect();
                    let c = char::from_u32(u32::from_str_radix(&h, 16).ok()?)?;
                    let mut b = [0; 4];
                    out.extend_from_slice(c.encode_utf8(&mut b).as_bytes());
                }
                _ => return None,
            }
        }
        Some(out)
    }

    /// Characters no output may hold raw.
    fn forbidden(c: char) -> bool {
        c.is_control()
            || (c.is_whitespace() && c != ' ')
            || matches!(u32::from(c), 0x200B..=0x200F | 0x202A..=0x202E | 0x2060..=0x2069 | 0xFEFF | 0xAD | 0xE0000..=0xE007F)
            || INVISIBLE_LETTERS.contains(&c)
    }

    #[test]
    fn forged_lines_and_terminal_controls_are_escaped() {
        let forged = "x\naudit: detach \"prod\" by uid=1000 pid=4242: ok";
        assert_eq!(
            quoted(forged).to_string(),
            r#""x\naudit: detach \"prod\" by uid=1000 pid=4242: ok""#
        );
        assert_eq!(
            escape("a\u{1b}[31mb\rc\u{202e}d\u{2066}e\u{200b}f"),
            r"a\u{1b}[31mb\rc\u{202e}d\u{2066}e\u{200b}f"
        );
        assert_eq!(escape("plain name-1.img"), "plain name-1.img");
        assert!(matches!(escape("plain"), Cow::Borrowed(_)));
        assert_eq!(escape(r"a\b"), r"a\\b");
        assert_eq!(escape("ünïcødé 名前"), "ünïcødé 名前");
        assert_eq!(escape("\u{3164}"), r"\u{3164}");
        assert_eq!(escape("a\u{a0}b"), r"a\u{a0}b");
        assert_eq!(escape("\u{85}\u{2028}\u{7f}"), r"\u{85}\u{2028}\u{7f}");
        // A combining mark, as Rust's Debug does (it could decorate a quote).
        assert_eq!(quoted("\u{301}e").to_string(), r#""\u{301}e""#);
    }

    #[test]
    fn sanitize_leaves_quoted_text_alone() {
        let q = quoted("a\nb\"c\\d").to_string();
        assert_eq!(sanitize_line(&q), q);
        assert_eq!(
            sanitize_line("cannot open /x\naudit: fake"),
            r"cannot open /x\naudit: fake"
        );
        assert_eq!(sanitize_line(r"C:\dir"), r"C:\dir");
    }

    #[test]
    fn paths_that_are_not_utf8_are_shown_as_bytes() {
        use std::os::unix::ffi::OsStrExt;
        let p = Path::new(std::ffi::OsStr::from_bytes(b"/img/\xff\xfe\n.img"));
        assert_eq!(quoted_path(p).to_string(), r#""/img/\xff\xfe\n.img""#);
    }

    proptest! {
        #[test]
        fn quoted_is_one_safe_line_and_reads_back(s in any::<String>()) {
            let q = quoted(&s).to_string();
            prop_assert!(!q.chars().any(forbidden), "{q:?}");
            prop_assert_eq!(unquote(&q), Some(s.clone().into_bytes()));
            let e = escape(&s);
            prop_assert!(!e.chars().any(forbidden), "{e:?}");
            let l = sanitize_line(&s);
            prop_assert!(!l.chars().any(forbidden), "{l:?}");
        }

        #[test]
        fn quoted_bytes_read_back(b in proptest::collection::vec(any::<u8>(), 0..64)) {
            let q = quoted_bytes(&b).to_string();
            prop_assert!(!q.chars().any(forbidden), "{q:?}");
            prop_assert_eq!(unquote(&q), Some(b));
        }

        #[test]
        fn hostile_unicode_is_escaped(s in "[\\x00-\\x1f\\x7f-\\u{9f}\\u{200b}-\\u{200f}\\u{2028}-\\u{202e}\\u{2060}-\\u{2069}\\u{feff}a\"\\\\]{0,24}") {
            let q = quoted(&s).to_string();
            prop_assert!(!q.chars().any(forbidden), "{q:?}");
            prop_assert_eq!(unquote(&q), Some(s.into_bytes()));
        }
    }

    // clip / untrusted
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
        fn clipped_output_is_one_bounded_printable_line(s in proptest::collection::vec(any::<u8>(), 0..600),
                                                max in 0usize..100) {
            let out = clip(&s, max);
            prop_assert!(out.len() <= 10 * max + 30, "{} bytes: {out}", out.len());
            prop_assert!(out.starts_with('"'));
            prop_assert!(!out.chars().any(forbidden), "{out:?}");
        }

        #[test]
        fn short_utf8_round_trips_through_the_escapes(s in "[a-zA-Z0-9 ._/-]{0,64}") {
            prop_assert_eq!(clip(s.as_bytes(), 64), format!("\"{s}\""));
        }
    }

    #[test]
    fn each_cause_is_printed_once() {
        let io = std::io::Error::from(std::io::ErrorKind::AddrInUse);
        let twice = format!("cannot listen: {io}");
        assert_eq!(
            join_causes([twice.clone(), io.to_string()]),
            twice,
            "a cause the text holds is left out"
        );
        assert_eq!(
            join_causes(["a".to_owned(), String::new(), "b".into(), "b".into()]),
            "a: b"
        );
    }
}
