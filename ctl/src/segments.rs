//! Segment lists for `xferctl cp --segments`: one segment per line, `SRC_OFF DST_OFF LEN`, with
//! sizes in the usual units (`64KiB`, `1Mi`); blank lines and `#` comments are skipped. The
//! compact form for strided blocks appends `xCOUNT [SRC_STRIDE [DST_STRIDE]]` (strides default
//! to `LEN`, i.e. back to back): `0 0 64KiB x2048 128KiB 64KiB` is 2,048 blocks of 64 KiB read
//! every 128 KiB of the source and written back to back. Offsets are relative to the `@OFFSET`
//! of `SRC` and `DST` (0 by default). Errors name the line.
use crate::units::parse_size;

/// A segment in source/destination terms, as the user wrote it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seg {
    pub src: u64,
    pub dst: u64,
    pub len: u64,
}

/// Most segments one list may expand to (the agent's own limit, `transfer.max_segments`, is
/// usually lower and answers RESOURCE_EXHAUSTED); bounds what a typo can make xferctl allocate.
pub const MAX_EXPANDED: u64 = 1 << 20;

/// Longest list text read (`--segments FILE` or stdin): a million plain lines fit, and a file
/// such as `/dev/zero` given by mistake is an error, not an allocation without end.
pub const MAX_TEXT: u64 = 128 << 20;

/// Reads a whole list of at most [`MAX_TEXT`] bytes from `r`.
pub fn read_text(r: impl std::io::Read) -> Result<String, String> {
    read_at_most(r, MAX_TEXT)
}

fn read_at_most(r: impl std::io::Read, max: u64) -> Result<String, String> {
    use std::io::Read;
    let mut text = String::new();
    r.take(max.saturating_add(1)).read_to_string(&mut text).map_err(|e| e.to_string())?;
    if text.len() as u64 > max {
        return Err(format!("the segment list is longer than {max} bytes"));
    }
    Ok(text)
}

/// Parses a whole list (see the module docs). Every size computation is checked: a count,
/// stride or offset whose blocks would pass 2^64 bytes, or a list past [`MAX_EXPANDED`]
/// segments, is an error naming the line, found before anything is allocated for it.
pub fn parse(text: &str) -> Result<Vec<Seg>, String> {
    let mut out: Vec<Seg> = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let at = |e: String| format!("line {}: {e}", i + 1);
        let fields: Vec<&str> = line.split_whitespace().collect();
        let size = |s: &str, what: &str| parse_size(s).map_err(|e| at(format!("{what} {s:?}: {e}")));
        let (src, dst, len) = match fields.as_slice() {
            [s, d, l, ..] => (size(s, "source offset")?, size(d, "destination offset")?, size(l, "length")?),
            _ => return Err(at(format!("expected `SRC_OFF DST_OFF LEN [xCOUNT [SRC_STRIDE [DST_STRIDE]]]`, got {line:?}"))),
        };
        let (count, src_stride, dst_stride) = match &fields[3..] {
            [] => (1, len, len),
            [c, rest @ ..] if rest.len() <= 2 => {
                let n = c
                    .strip_prefix('x')
                    .ok_or_else(|| at(format!("expected xCOUNT after the length, got {c:?}")))?
                    .parse::<u64>()
                    .map_err(|e| at(format!("count {c:?}: {e}")))?;
                let ss = rest.first().map(|s| size(s, "source stride")).transpose()?.unwrap_or(len);
                let ds = rest.get(1).map(|s| size(s, "destination stride")).transpose()?.unwrap_or(len);
                (n, ss, ds)
            }
            _ => return Err(at("too many fields".into())),
        };
        if count == 0 {
            return Err(at("a count of x0 moves nothing; leave the line out".into()));
        }
        // Checked: `out.len() + count` with a count near 2^64 would wrap below the bound.
        let total = (out.len() as u64).checked_add(count).filter(|t| *t <= MAX_EXPANDED);
        if total.is_none() {
            return Err(at(format!("the list expands to more than {MAX_EXPANDED} segments (this line adds {count})")));
        }
        // The last block is the farthest one: if it fits, every block before it does.
        let last = count - 1;
        let end = |base: u64, stride: u64, side: &str| {
            last.checked_mul(stride)
                .and_then(|d| base.checked_add(d))
                .and_then(|o| o.checked_add(len))
                .ok_or_else(|| at(format!("block {last} ends past 2^64 bytes on the {side} side")))
        };
        end(src, src_stride, "source")?;
        end(dst, dst_stride, "destination")?;
        // Bounded by MAX_EXPANDED above, and no offset below can overflow.
        out.reserve(count as usize);
        let mut s = src;
        let mut d = dst;
        for k in 0..count {
            out.push(Seg { src: s, dst: d, len });
            if k < last {
                s += src_stride;
                d += dst_stride;
            }
        }
    }
    if out.is_empty() {
        return Err("the segment list is empty".into());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_comments_units_and_strides() {
        let text = "# kv blocks\n0 1MiB 4KiB\n\n8KiB 0 4KiB # trailing\n0 2MiB 1KiB x3 2KiB\n0 0 16 x2 32 64\n";
        let got = parse(text).unwrap();
        assert_eq!(
            got,
            vec![
                Seg { src: 0, dst: 1 << 20, len: 4096 },
                Seg { src: 8192, dst: 0, len: 4096 },
                Seg { src: 0, dst: 2 << 20, len: 1024 },
                Seg { src: 2048, dst: (2 << 20) + 1024, len: 1024 },
                Seg { src: 4096, dst: (2 << 20) + 2048, len: 1024 },
                Seg { src: 0, dst: 0, len: 16 },
                Seg { src: 32, dst: 64, len: 16 },
            ]
        );
    }

    #[test]
    fn errors_name_the_line() {
        assert!(parse("").unwrap_err().contains("empty"));
        assert!(parse("# only a comment\n").unwrap_err().contains("empty"));
        assert!(parse("0 0\n").unwrap_err().starts_with("line 1:"));
        assert!(parse("0 0 1\n0 0 zz\n").unwrap_err().starts_with("line 2: length"));
        assert!(parse("0 0 1 3\n").unwrap_err().contains("xCOUNT"));
        assert!(parse("0 0 1 x1 1 1 1\n").unwrap_err().contains("too many"));
        assert!(parse(&format!("0 0 1 x{}\n", MAX_EXPANDED + 1)).unwrap_err().contains("expands"));
        assert!(parse("18446744073709551615 0 1 x2\n").unwrap_err().contains("past 2^64"));
    }

    /// Hostile lists: every one is an error naming its line, found without allocating for it.
    #[test]
    fn hostile_counts_and_offsets_are_refused_before_allocating() {
        let max = u64::MAX;
        let cases: Vec<(String, &str)> = vec![
            // After another line, a count near 2^64 wrapped the old `len + count` guard.
            (format!("0 0 1\n0 0 1 x{max}\n"), "line 2: the list expands"),
            (format!("0 0 1\n0 0 1 x{}\n", max - 1), "line 2: the list expands"),
            (format!("0 0 1 x{max}\n"), "line 1: the list expands"),
            // Counts that only sum past the bound.
            (format!("0 0 1 x{MAX_EXPANDED}\n0 0 1\n"), "line 2: the list expands"),
            (format!("0 0 1 x{}\n0 0 1 x{}\n", MAX_EXPANDED / 2, MAX_EXPANDED / 2 + 1), "line 2: the list expands"),
            (format!("0 0 1 x{}\n", MAX_EXPANDED + 1), "line 1: the list expands"),
            (format!("0 0 1 x{}\n", u64::MAX / 2 + 1), "line 1: the list expands"),
            ("0 0 1 x0\n".into(), "line 1: a count of x0"),
            ("0 0 1 x18446744073709551616\n".into(), "line 1: count"),
            ("0 0 1 x-1\n".into(), "line 1: count"),
            // offset + len past 2^64 on either side, for a single segment and for the last block.
            (format!("{max} 0 1\n"), "line 1: block 0 ends past 2^64 bytes on the source side"),
            (format!("0 {max} 1\n"), "line 1: block 0 ends past 2^64 bytes on the destination side"),
            (format!("1 0 {max}\n"), "source side"),
            (format!("0 0 1 x2 {max}\n"), "line 1: block 1 ends past 2^64 bytes on the source side"),
            (format!("0 0 1 x2 1 {max}\n"), "line 1: block 1 ends past 2^64 bytes on the destination side"),
            (format!("0 0 1\n0 0 4096 x1048575 {}\n", max / 1_000_000), "line 2: block 1048574 ends past 2^64"),
            ("0 0 16EiB\n".into(), "line 1: length"),
        ];
        for (text, want) in &cases {
            let e = parse(text).unwrap_err();
            assert!(e.contains(want), "{text:?}: {e:?} does not say {want:?}");
        }
        // Up to the bound is fine, and the last block may end exactly at 2^64.
        assert_eq!(parse(&format!("0 0 1 x{}\n0 0 1\n", MAX_EXPANDED - 1)).unwrap().len() as u64, MAX_EXPANDED);
        let top = parse(&format!("{} 0 1 x2\n", max - 2)).unwrap();
        assert_eq!(top[1], Seg { src: max - 1, dst: 1, len: 1 });
    }

    #[test]
    fn list_text_is_bounded() {
        assert_eq!(read_text("0 0 1\n".as_bytes()).unwrap(), "0 0 1\n");
        assert_eq!(read_at_most("0 0 1\n".as_bytes(), 6).unwrap(), "0 0 1\n");
        // An endless input (`/dev/zero`, `yes`) stops at the bound.
        let e = read_at_most(std::io::repeat(b'\n'), 1 << 16).unwrap_err();
        assert!(e.contains("longer than 65536 bytes"), "{e}");
        assert!(read_text(&[0xffu8, 0xfe][..]).is_err(), "not UTF-8");
    }
}
