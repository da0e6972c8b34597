//! The checker behind `tests/layers.rs`: [`lex`] (Rust source → tokens
//! without comments or literals; lines of code), [`paths`] (the paths a file
//! names, made absolute), [`tree`] (every file of `src/`, each path resolved
//! to the file defining it, and the queries each rule asks). Its own tests:
//! `tests.rs`.

pub mod lex;
pub mod paths;
pub mod tree;

#[cfg(test)]
mod tests;
