//! `--out DIR` of the commands that write a directory (`init-model`, `adapters merge`): they
//! never delete or overwrite what they did not create unless asked with `--force`, and never,
//! even then, a directory their own inputs live in.

use std::path::Path;

use anyhow::{bail, Result};

/// Refuses `out` when it exists and is not an empty directory (unless `force`), or when it is,
/// or holds, one of `inputs` (always: writing there would destroy what is being read).
pub fn check_out_dir(out: &Path, force: bool, inputs: &[&Path]) -> Result<()> {
    let shown = out.display();
    let metadata = match std::fs::symlink_metadata(out) {
        Ok(metadata) => metadata,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(err) => bail!("--out {shown}: cannot read it: {err}"),
    };
    if metadata.file_type().is_symlink() {
        bail!("--out {shown} is a symbolic link; give the directory itself");
    }
    if !metadata.is_dir() {
        bail!("--out {shown} is a file, not a directory; it is left as it is");
    }
    if let Ok(out_real) = out.canonicalize() {
        for input in inputs {
            if let Ok(input_real) = input.canonicalize() {
                if input_real.starts_with(&out_real) {
                    bail!(
                        "--out {shown} holds {}, which this command reads; write the result elsewhere",
                        input.display()
                    );
                }
            }
        }
    }
    let entries = std::fs::read_dir(out).map_err(|err| anyhow::anyhow!("--out {shown}: cannot list it: {err}"))?;
    let count = entries.count();
    if count > 0 && !force {
        bail!(
            "--out {shown} is not empty ({count} entr{}); its contents would be replaced: give an empty or new \
             directory, or --force to replace them",
            if count == 1 { "y" } else { "ies" }
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_non_empty_files_and_inputs() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out");
        check_out_dir(&out, false, &[]).expect("a new directory is fine");
        std::fs::create_dir(&out).unwrap();
        check_out_dir(&out, false, &[]).expect("an empty directory is fine");
        std::fs::write(out.join("keep.txt"), "x").unwrap();
        let err = check_out_dir(&out, false, &[]).unwrap_err().to_string();
        assert!(err.contains("is not empty (1 entry)") && err.contains("--force"), "{err}");
        check_out_dir(&out, true, &[]).expect("--force replaces");
        let err = check_out_dir(&out, true, &[out.join("keep.txt").as_path()]).unwrap_err().to_string();
        assert!(err.contains("which this command reads"), "{err}");
        let err = check_out_dir(&out.join("keep.txt"), true, &[]).unwrap_err().to_string();
        assert!(err.contains("is a file, not a directory"), "{err}");
    }
}
