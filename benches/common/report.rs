//! Where a benchmark's report goes: printed, and written under this crate's
//! `target/bench-reports/` as markdown and, when the benchmark has one, JSON.

use std::path::PathBuf;

/// The directory every benchmark writes its reports to.
pub fn dir() -> PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/bench-reports")
}

/// Prints `md` and writes it to `<name>.md`, and `json` (when given) to `<name>.json`, in
/// [`dir`]; says where they went, or why they could not be written (a report that cannot be
/// saved does not fail the measurement that was printed).
pub fn publish(name: &str, md: &str, json: Option<&serde_json::Value>) {
    println!("\n{md}");
    let dir = dir();
    let mut written = vec![format!("{name}.md")];
    let mut result = std::fs::create_dir_all(&dir)
        .and_then(|()| std::fs::write(dir.join(format!("{name}.md")), md));
    if let Some(json) = json {
        let text = serde_json::to_string_pretty(json).expect("a JSON value serialises") + "\n";
        result = result.and_then(|()| std::fs::write(dir.join(format!("{name}.json")), text));
        written.push(format!("{name}.json"));
    }
    match result {
        Ok(()) => eprintln!("wrote {} in {}", written.join(" and "), dir.display()),
        Err(error) => eprintln!(
            "could not write the {name} report under {}: {error}",
            dir.display()
        ),
    }
}
