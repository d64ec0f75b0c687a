//! TCP fabric (placeholder while the lead writes it).
