//! Build script. With feature `cuda` it compiles every `src/cuda/**/*.cu` with nvcc into an sm_90a
//! cubin and generates `$OUT_DIR/cubins.rs`, which embeds them (see `src/cuda/mod.rs`). Without the
//! feature it does nothing, so CPU-only builds need no CUDA toolkit.
//!
//! Why nvcc at build time (spec/TOOLCHAIN.md §8): kernel errors show up at `cargo build` on any
//! machine, the GPU machine needs only libcuda, and what runs is exactly what was compiled here.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    if let Err(msg) = build_kernels() {
        // A panic message is what cargo shows for a failed build script; keep it readable.
        panic!("\n\nlily (feature `cuda`): {msg}\n");
    }
}

/// nvcc flags for every kernel file. The `-gencode` form (not `-arch=sm_90a`) is the one known to
/// emit sm_90a code with every 13.x nvcc (spec/TOOLCHAIN.md §3.2).
const NVCC_FLAGS: &[&str] = &[
    "-gencode=arch=compute_90a,code=sm_90a",
    "-cubin",
    "-O3",
    "-std=c++17",
    "-Xptxas=-v",
];

/// Modules built a second time with the decode timeline's stamps (`-DLILY_TIMELINE`, common.cuh),
/// embedded as `<name>+timeline`: the kernels of a decode step (src/cuda/timeline.rs).
const TIMELINE_MODULES: &[&str] = &[
    "attention",
    "dense",
    "embed",
    "gdn",
    "gemm",
    "gemm_prefill",
    "gemm_wgmma",
    "moe",
    "norm",
    "sample",
];

fn build_kernels() -> Result<(), String> {
    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let out_dir = PathBuf::from(env::var("OUT_DIR").unwrap());
    let cuda_dir = manifest_dir.join("src/cuda");
    println!("cargo:rerun-if-env-changed=NVCC");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    // The directory line catches added files; the per-file lines are what cargo compares mtimes of.
    println!("cargo:rerun-if-changed={}", cuda_dir.display());

    let nvcc = find_nvcc(&manifest_dir).ok_or(
        "nvcc not found. Run `scripts/setup-cuda.sh` (installs the pinned CUDA 13.0 wheels into \
         .venv-cuda), or set NVCC=/path/to/nvcc or CUDA_HOME.",
    )?;
    check_nvcc_version(&nvcc)?;

    let mut sources = Vec::new();
    collect_files(&cuda_dir, &mut sources)
        .map_err(|e| format!("reading {}: {e}", cuda_dir.display()))?;
    sources.sort();
    for path in &sources {
        println!("cargo:rerun-if-changed={}", path.display());
    }
    // Headers are shared by all kernel files, so any change to one recompiles every .cu.
    let headers: Vec<&PathBuf> = sources.iter().filter(|p| has_ext(p, "cuh")).collect();
    let header_text: String = headers
        .iter()
        .map(|p| fs::read_to_string(p).map_err(|e| format!("reading {}: {e}", p.display())))
        .collect::<Result<_, _>>()?;
    let mut kernels: Vec<(String, &PathBuf)> = sources
        .iter()
        .filter(|p| has_ext(p, "cu"))
        .map(|p| (module_name(&cuda_dir, p), p))
        .collect();
    let timeline: Vec<(String, &PathBuf)> = kernels
        .iter()
        .filter(|(name, _)| TIMELINE_MODULES.contains(&name.as_str()))
        .map(|(name, p)| (format!("{name}+timeline"), *p))
        .collect();
    kernels.extend(timeline);

    // Compile in parallel, at most as many nvcc processes as cargo allows jobs.
    let jobs: usize = env::var("NUM_JOBS")
        .ok()
        .and_then(|j| j.parse().ok())
        .unwrap_or(1)
        .max(1);
    let next = std::sync::atomic::AtomicUsize::new(0);
    let errors: Vec<String> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..jobs.min(kernels.len()))
            .map(|_| {
                scope.spawn(|| {
                    let mut errors = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some((name, src)) = kernels.get(i) else {
                            break;
                        };
                        if let Err(e) = compile(&nvcc, &cuda_dir, src, name, &header_text, &out_dir)
                        {
                            errors.push(e);
                        }
                    }
                    errors
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().unwrap())
            .collect()
    });
    if !errors.is_empty() {
        return Err(errors.join("\n"));
    }

    // The generated table: (module name, cubin bytes). The name is the .cu path under src/cuda
    // without its extension, e.g. "gemm" or "attention/decode".
    let mut table = String::from(
        "/// Every kernel module built by build.rs: (name, sm_90a cubin).\n\
         pub const CUBINS: &[(&str, &[u8])] = &[\n",
    );
    for (name, _) in &kernels {
        let cubin = out_dir.join(format!("{}.cubin", name.replace('/', "__")));
        table.push_str(&format!(
            "    ({name:?}, include_bytes!({:?})),\n",
            cubin.display().to_string()
        ));
    }
    table.push_str("];\n");
    fs::write(out_dir.join("cubins.rs"), table).map_err(|e| format!("writing cubins.rs: {e}"))
}

/// nvcc from `$NVCC`, `$CUDA_HOME/bin`, the repo's `.venv-cuda` (scripts/setup-cuda.sh), then PATH.
fn find_nvcc(manifest_dir: &Path) -> Option<PathBuf> {
    if let Some(nvcc) = env::var_os("NVCC") {
        return Some(PathBuf::from(nvcc)); // an explicit choice: if it is wrong, say so (below)
    }
    if let Some(home) = env::var_os("CUDA_HOME") {
        let nvcc = Path::new(&home).join("bin/nvcc");
        if nvcc.is_file() {
            return Some(nvcc);
        }
    }
    // The wheels put nvcc under lib/pythonX.Y/site-packages/nvidia/cu13/bin.
    if let Ok(entries) = fs::read_dir(manifest_dir.join(".venv-cuda/lib")) {
        for entry in entries.flatten() {
            let nvcc = entry.path().join("site-packages/nvidia/cu13/bin/nvcc");
            if nvcc.is_file() {
                return Some(nvcc);
            }
        }
    }
    env::split_paths(&env::var_os("PATH")?)
        .map(|dir| dir.join("nvcc"))
        .find(|p| p.is_file())
}

/// The kernels are pinned to CUDA 13.0 (the GPU machine's driver is 580 / CUDA 13.0). A newer nvcc's
/// cubins still load there, so another version is a warning, not an error.
fn check_nvcc_version(nvcc: &Path) -> Result<(), String> {
    let out = Command::new(nvcc).arg("--version").output().map_err(|e| {
        format!(
            "cannot run nvcc at {} ({e}). Run `scripts/setup-cuda.sh`, or fix NVCC / CUDA_HOME.",
            nvcc.display()
        )
    })?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !text.contains("release 13.0") {
        println!(
            "cargo:warning=nvcc at {} is not CUDA 13.0 (pinned: 13.0.88): {}",
            nvcc.display(),
            text.lines().last().unwrap_or("")
        );
    }
    Ok(())
}

/// Compiles one .cu file unless its cubin is already up to date. Cargo reruns this script when any
/// file under src/cuda changes (a .rs edit too), so each cubin is stamped with a hash of everything
/// that goes into it, and unchanged kernels are not recompiled.
fn compile(
    nvcc: &Path,
    cuda_dir: &Path,
    src: &Path,
    name: &str,
    headers: &str,
    out_dir: &Path,
) -> Result<(), String> {
    use std::hash::{Hash, Hasher};
    let base = out_dir.join(name.replace('/', "__"));
    let cubin = base.with_extension("cubin");
    let stamp = base.with_extension("stamp");
    let log = base.with_extension("ptxas.txt");

    let defines: &[&str] = if name.ends_with("+timeline") {
        &["-DLILY_TIMELINE"]
    } else {
        &[]
    };
    let text = fs::read_to_string(src).map_err(|e| format!("reading {}: {e}", src.display()))?;
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    (text.as_str(), headers, NVCC_FLAGS, defines, nvcc).hash(&mut hasher);
    let key = format!("{:016x}", hasher.finish());
    if cubin.is_file() && fs::read_to_string(&stamp).is_ok_and(|s| s == key) {
        return Ok(());
    }

    let out = Command::new(nvcc)
        .args(NVCC_FLAGS)
        .args(defines)
        .arg("-I")
        .arg(cuda_dir)
        .arg("-o")
        .arg(&cubin)
        .arg(src)
        .output()
        .map_err(|e| format!("running {}: {e}", nvcc.display()))?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        return Err(format!("nvcc failed on {}:\n{stderr}", src.display()));
    }
    // ptxas -v prints registers, shared memory and spills per kernel: kept for inspection.
    fs::write(&log, stderr.as_bytes()).map_err(|e| format!("writing {}: {e}", log.display()))?;
    for line in stderr.lines().filter(|l| l.contains("warning")) {
        println!("cargo:warning={name}.cu: {line}");
    }
    fs::write(&stamp, key).map_err(|e| format!("writing {}: {e}", stamp.display()))
}

fn collect_files(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            collect_files(&path, out)?;
        } else if has_ext(&path, "cu") || has_ext(&path, "cuh") {
            out.push(path);
        }
    }
    Ok(())
}

fn has_ext(path: &Path, ext: &str) -> bool {
    path.extension().is_some_and(|e| e == ext)
}

fn module_name(cuda_dir: &Path, src: &Path) -> String {
    let rel = src.strip_prefix(cuda_dir).unwrap().with_extension("");
    rel.to_string_lossy().replace('\\', "/")
}
