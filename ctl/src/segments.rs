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

/// Parses a whole list (see the module docs).
pub fn parse(text: &str) -> Result<Vec<Seg>, String> {
    let mut out = Vec::new();
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
        if out.len() as u64 + count > MAX_EXPANDED {
            return Err(at(format!("the list expands to more than {MAX_EXPANDED} segments")));
        }
        for k in 0..count {
            let off = |base: u64, stride: u64| {
                k.checked_mul(stride).and_then(|d| base.checked_add(d)).ok_or_else(|| at(format!("block {k} overflows")))
            };
            out.push(Seg { src: off(src, src_stride)?, dst: off(dst, dst_stride)?, len });
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
        assert!(parse("18446744073709551615 0 1 x2\n").unwrap_err().contains("overflows"));
    }
}
