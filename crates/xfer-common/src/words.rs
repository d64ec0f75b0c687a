//! Configuration words (`tcp`, `json`, `mw`, ...): one of a fixed set, case-insensitive, with an
//! error that names the value and the choices (serde's own reads "enum X does not have variant
//! constructor y").

/// `value` as one of `choices` (name → value).
pub fn one_of<T: Copy>(value: &str, choices: &[(&str, T)]) -> Result<T, String> {
    let v = value.trim().to_ascii_lowercase();
    choices.iter().find(|(name, _)| *name == v).map(|(_, t)| *t).ok_or_else(|| {
        let names: Vec<&str> = choices.iter().map(|(n, _)| *n).collect();
        format!("{value:?} is not one of: {}", names.join(", "))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_match_case_insensitively_and_errors_list_the_choices() {
        let c = [("mr", 1), ("mw", 2)];
        assert_eq!(one_of(" MW ", &c), Ok(2));
        assert_eq!(one_of("window", &c), Err("\"window\" is not one of: mr, mw".to_string()));
    }
}
