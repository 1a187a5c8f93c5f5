//! What every benchmark report shares.

/// Prints a markdown report and writes it to `target/bench-reports/<name>.md`.
pub fn publish(name: &str, report: &str) {
    println!("\n{report}");
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/bench-reports");
    if let Err(error) = std::fs::create_dir_all(&dir)
        .and_then(|()| std::fs::write(dir.join(format!("{name}.md")), report))
    {
        eprintln!(
            "could not write the {name} report under {}: {error}",
            dir.display()
        );
    }
}
