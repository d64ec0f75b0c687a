//! The source tree as tidy reads it: every product `.rs` file, split into code (comments removed,
//! the insides of string and char literals blanked, so neither is mistaken for code) and comments,
//! with the lines that are test code marked.
//!
//! Test code is recognised by what it is, not by where it sits: an item under `#[cfg(test)]` (a
//! `mod NAME { … }` block above all, but also a test-only `fn` or `impl`), brace-matched to its
//! end, and the file of a `#[cfg(test)] mod NAME;` (with everything beneath it). Code after such an
//! item is product code again. Integration tests (`tests/`, `benches/` next to a crate's `src/`)
//! and build output are not product code.
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("agent/ has a parent").to_path_buf()
}

/// Where product code lives, relative to the workspace root.
pub const PRODUCT_DIRS: &[&str] = &["agent/src", "ctl/src", "proto/src", "proto/build.rs", "crates"];

/// One source file.
pub struct Source {
    /// Relative to the workspace root.
    pub path: PathBuf,
    pub text: String,
    /// Per line: the code, comments removed and literal contents blanked.
    pub code: Vec<String>,
    /// Per line: the comment text on it (`//…` or the part of a `/* … */` on that line).
    pub comments: Vec<String>,
    /// Per line: part of a `#[cfg(test)]` item.
    pub test: Vec<bool>,
    /// Names of the `#[cfg(test)] mod NAME;` this file declares.
    pub test_mods: Vec<String>,
}

impl Source {
    pub fn read(root: &Path, path: &Path) -> Source {
        let text = std::fs::read_to_string(path).expect("read source");
        Source::parse(path.strip_prefix(root).unwrap_or(path), text)
    }

    /// `text` as the file at `path` (relative to the workspace root).
    pub fn parse(path: &Path, text: String) -> Source {
        let (code, comments) = lex(&text);
        let (test, test_mods) = test_items(&code);
        Source { path: path.to_path_buf(), text, code, comments, test, test_mods }
    }

    /// (1-based line number, line) of every line that is not test code.
    pub fn product_lines(&self) -> impl Iterator<Item = (usize, &str)> {
        self.text.lines().enumerate().filter(|(i, _)| !self.test.get(*i).copied().unwrap_or(false)).map(|(i, l)| (i + 1, l))
    }

    /// (1-based line number, code) of every line that is not test code.
    pub fn product_code(&self) -> impl Iterator<Item = (usize, &str)> {
        self.code.iter().enumerate().filter(|(i, _)| !self.test[*i]).map(|(i, l)| (i + 1, l.as_str()))
    }

    pub fn display(&self) -> String {
        self.path.display().to_string()
    }
}

/// Every `.rs` file of the product: under [`PRODUCT_DIRS`], without build output, integration
/// tests and benches of a crate, and the files of `#[cfg(test)] mod NAME;` declarations.
pub fn product_sources() -> Vec<Source> {
    let root = workspace_root();
    let mut files = Vec::new();
    let mut stack: Vec<PathBuf> = PRODUCT_DIRS.iter().map(|d| root.join(d)).collect();
    while let Some(p) = stack.pop() {
        if p.is_dir() {
            let Ok(rd) = std::fs::read_dir(&p) else { continue };
            for e in rd.flatten() {
                let name = e.file_name();
                let crate_level = p.join("Cargo.toml").is_file();
                if name == "target" || (crate_level && (name == "tests" || name == "benches")) {
                    continue;
                }
                stack.push(e.path());
            }
        } else if p.extension().is_some_and(|x| x == "rs") {
            files.push(Source::read(&root, &p));
        }
    }
    // Files (and directories) of test modules declared with `#[cfg(test)] mod NAME;`.
    let mut test_paths = BTreeSet::new();
    for f in &files {
        let dir = module_dir(&f.path);
        for m in &f.test_mods {
            test_paths.insert(dir.join(format!("{m}.rs")));
            test_paths.insert(dir.join(m));
        }
    }
    files.retain(|f| !test_paths.iter().any(|t| f.path.starts_with(t)));
    files.sort_by(|a, b| a.path.cmp(&b.path));
    assert!(files.len() > 20, "tidy found only {} source files under {}", files.len(), root.display());
    files
}

/// The directory where the child modules of the module in `file` live: beside `lib.rs`,
/// `main.rs` and `mod.rs`, in `foo/` for `foo.rs`.
pub fn module_dir(file: &Path) -> PathBuf {
    let dir = file.parent().unwrap_or(Path::new("")).to_path_buf();
    match file.file_stem().and_then(|s| s.to_str()) {
        Some("lib" | "main" | "mod") | None => dir,
        Some(stem) => dir.join(stem),
    }
}

/// Splits `text` into per-line code and comments. Literals keep their delimiters and line count,
/// their contents become spaces.
fn lex(text: &str) -> (Vec<String>, Vec<String>) {
    let c: Vec<char> = text.chars().collect();
    let mut code = String::with_capacity(text.len());
    let mut comment = String::with_capacity(text.len() / 4);
    // Every char goes to exactly one of code/comment; the other gets a space (newlines to both),
    // so both split into the same lines.
    let emit = |ch: char, in_comment: bool, code: &mut String, comment: &mut String| {
        if ch == '\n' {
            code.push('\n');
            comment.push('\n');
        } else if in_comment {
            code.push(' ');
            comment.push(ch);
        } else {
            code.push(ch);
            comment.push(' ');
        }
    };
    let blank = |ch: char| if ch == '\n' { '\n' } else { ' ' };
    let ident = |ch: char| ch.is_alphanumeric() || ch == '_';
    let mut i = 0;
    while i < c.len() {
        let ch = c[i];
        let next = c.get(i + 1).copied();
        if ch == '/' && next == Some('/') {
            while i < c.len() && c[i] != '\n' {
                emit(c[i], true, &mut code, &mut comment);
                i += 1;
            }
        } else if ch == '/' && next == Some('*') {
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && c.get(i + 1) == Some(&'*') {
                    depth += 1;
                    emit('/', true, &mut code, &mut comment);
                    emit('*', true, &mut code, &mut comment);
                    i += 2;
                } else if c[i] == '*' && c.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    emit('*', true, &mut code, &mut comment);
                    emit('/', true, &mut code, &mut comment);
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    emit(c[i], true, &mut code, &mut comment);
                    i += 1;
                }
            }
        } else if (ch == 'r' || (ch == 'b' && next == Some('r')))
            && (i == 0 || !ident(c[i - 1]))
            && raw_string_hashes(&c, i + if ch == 'b' { 2 } else { 1 }).is_some()
        {
            // r"…", r#"…"#, br"…": no escapes; ends at `"` followed by as many `#`.
            let start = i + if ch == 'b' { 2 } else { 1 };
            let hashes = raw_string_hashes(&c, start).unwrap_or(0);
            let open_end = start + hashes + 1;
            for &d in &c[i..open_end] {
                emit(d, false, &mut code, &mut comment);
            }
            i = open_end;
            while i < c.len() {
                if c[i] == '"' && (0..hashes).all(|k| c.get(i + 1 + k) == Some(&'#')) {
                    for &d in &c[i..i + 1 + hashes] {
                        emit(d, false, &mut code, &mut comment);
                    }
                    i += 1 + hashes;
                    break;
                }
                emit(blank(c[i]), false, &mut code, &mut comment);
                i += 1;
            }
        } else if ch == '"' {
            emit('"', false, &mut code, &mut comment);
            i += 1;
            while i < c.len() && c[i] != '"' {
                if c[i] == '\\' {
                    emit(' ', false, &mut code, &mut comment);
                    i += 1;
                }
                if i < c.len() {
                    emit(blank(c[i]), false, &mut code, &mut comment);
                    i += 1;
                }
            }
            if i < c.len() {
                emit('"', false, &mut code, &mut comment);
                i += 1;
            }
        } else if ch == '\'' && (next == Some('\\') || c.get(i + 2) == Some(&'\'')) {
            // A char literal ('x', '\n', '\u{..}', '\''); a lifetime or label has no closing quote.
            emit('\'', false, &mut code, &mut comment);
            i += 1;
            if c.get(i) == Some(&'\\') {
                emit(' ', false, &mut code, &mut comment);
                i += 1;
            }
            if i < c.len() {
                emit(' ', false, &mut code, &mut comment);
                i += 1;
            }
            while i < c.len() && c[i] != '\'' && c[i] != '\n' {
                emit(' ', false, &mut code, &mut comment);
                i += 1;
            }
            if c.get(i) == Some(&'\'') {
                emit('\'', false, &mut code, &mut comment);
                i += 1;
            }
        } else {
            emit(ch, false, &mut code, &mut comment);
            i += 1;
        }
    }
    let lines = |s: &str| s.split('\n').map(str::to_string).collect::<Vec<_>>();
    let (mut code, mut comment) = (lines(&code), lines(&comment));
    // `str::lines` has no empty last line for a final newline.
    let n = text.lines().count();
    code.truncate(n);
    comment.truncate(n);
    (code, comment)
}

/// At `c[at..]`: `#`* then `"` (the opening of a raw string): the number of `#`.
fn raw_string_hashes(c: &[char], at: usize) -> Option<usize> {
    let hashes = c[at.min(c.len())..].iter().take_while(|&&ch| ch == '#').count();
    (c.get(at + hashes) == Some(&'"')).then_some(hashes)
}

/// Marks the lines of every `#[cfg(test)]` item in `code` (comments and literals already gone)
/// and returns the names of the `#[cfg(test)] mod NAME;` declarations.
fn test_items(code: &[String]) -> (Vec<bool>, Vec<String>) {
    let flat: Vec<char> = code.join("\n").chars().collect();
    let line_of: Vec<usize> = {
        let mut v = Vec::with_capacity(flat.len());
        let mut line = 0;
        for &ch in &flat {
            v.push(line);
            if ch == '\n' {
                line += 1;
            }
        }
        v
    };
    let mut test = vec![false; code.len()];
    let mut mods = Vec::new();
    let attr: Vec<char> = "#[cfg(test)]".chars().collect();
    let mut i = 0;
    while i + attr.len() <= flat.len() {
        if flat[i..i + attr.len()] != attr[..] {
            i += 1;
            continue;
        }
        let start = i;
        let mut j = i + attr.len();
        // Further attributes of the same item.
        loop {
            while j < flat.len() && flat[j].is_whitespace() {
                j += 1;
            }
            if flat.get(j) == Some(&'#') && flat.get(j + 1) == Some(&'[') {
                j = matching(&flat, j + 1).map_or(flat.len(), |e| e + 1);
            } else {
                break;
            }
        }
        let item_start = j;
        // The item ends at a `;` outside brackets, or with its first top-level `{ … }` block.
        let mut depth = 0i32;
        let mut end = flat.len().saturating_sub(1);
        while j < flat.len() {
            match flat[j] {
                '(' | '[' => depth += 1,
                ')' | ']' => depth -= 1,
                ';' if depth == 0 => {
                    end = j;
                    break;
                }
                '{' if depth == 0 => {
                    end = matching(&flat, j).unwrap_or(flat.len() - 1);
                    break;
                }
                _ => {}
            }
            j += 1;
        }
        let item: String = flat[item_start..=end.min(flat.len() - 1)].iter().collect();
        let words: Vec<&str> = item.split(|ch: char| !(ch.is_alphanumeric() || ch == '_')).filter(|w| !w.is_empty()).collect();
        let after_vis = words.iter().position(|w| *w == "mod").filter(|&p| p <= 3);
        if let Some(p) = after_vis {
            if item.trim_end().ends_with(';') {
                if let Some(name) = words.get(p + 1) {
                    mods.push(name.to_string());
                }
            }
        }
        for t in &mut test[line_of[start]..=line_of[end.min(flat.len() - 1)]] {
            *t = true;
        }
        i = end + 1;
    }
    (test, mods)
}

/// Index of the bracket that closes the one at `open` (`(`, `[` or `{`), counting all three.
fn matching(c: &[char], open: usize) -> Option<usize> {
    let mut depth = 0i32;
    for (k, &ch) in c.iter().enumerate().skip(open) {
        match ch {
            '(' | '[' | '{' => depth += 1,
            ')' | ']' | '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(k);
                }
            }
            _ => {}
        }
    }
    None
}
