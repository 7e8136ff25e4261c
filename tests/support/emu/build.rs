//! Building emulator programs with g++: one per (family, head dim) unit and per tool, with an
//! optional source mutation, cached under the target dir by a hash of every source and flag.

use super::*;

/// Every file under `dir`, sorted.
fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() {
                out.extend(files_under(&p));
            } else {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// A hash of the contents of every source a build can read (kernels, headers, emulator).
fn sources_hash() -> u64 {
    static H: OnceLock<u64> = OnceLock::new();
    *H.get_or_init(|| {
        let mut h = DefaultHasher::new();
        (CXXFLAGS, UBSAN).hash(&mut h);
        for f in files_under(&root().join("cuda")).into_iter().chain(files_under(&generated_include())) {
            f.hash(&mut h);
            std::fs::read(&f).unwrap_or_default().hash(&mut h);
        }
        h.finish()
    })
}

const CXXFLAGS: &[&str] = &[
    "-std=c++20",
    "-O2",
    "-g",
    "-fno-omit-frame-pointer",
    "-fno-strict-aliasing",
    "-Wall",
    "-Wextra",
    "-Wno-unknown-pragmas",
];

const UBSAN: &[&str] = &["-fsanitize=signed-integer-overflow,shift", "-fno-sanitize-recover=all"];

/// The headers build.rs generates (the numerics constants, build/numerics_header.rs).
pub fn generated_include() -> PathBuf {
    Path::new(env!("OUT_DIR")).join("include")
}

fn includes(cuda_root: &Path) -> Vec<String> {
    let emu = root().join("cuda/test/emu");
    vec![
        "-isystem".into(),
        emu.join("include").display().to_string(),
        "-I".into(),
        cuda_root.display().to_string(),
        "-I".into(),
        generated_include().display().to_string(),
        "-I".into(),
        emu.display().to_string(),
    ]
}

/// The launch-file line of one tensor map (driver.cpp's `tmap` directive).
pub fn tmap_directive(m: &TensorMapArgs) -> String {
    let s = &m.spec;
    let join = |v: &[u64]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(" ");
    let join32 = |v: &[u32]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(" ");
    format!(
        "tmap {} {} {:#x} {} {} {} {} {} {} {} {}",
        s.data_type,
        s.rank,
        m.global_address,
        join(&s.dims),
        join(&s.strides),
        join32(&s.box_dims),
        join32(&s.elem_strides),
        s.interleave,
        s.swizzle,
        s.l2_promotion,
        s.oob_fill
    )
}

fn gxx(args: &[String], what: &str) -> Result<(), String> {
    let out = Command::new("nice")
        .arg("g++")
        .args(args)
        .output()
        .map_err(|e| format!("cannot run g++ ({e}): the emulator needs g++ on PATH"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("g++ failed on {what}:\n{}", String::from_utf8_lossy(&out.stderr)))
    }
}

/// Builds (once per process and per content) `name` with `build`, which writes the file it is
/// given; concurrent callers of the same name wait for the first.
type BuildCell = Arc<OnceLock<Result<PathBuf, String>>>;
fn cached(name: &str, build: impl FnOnce(&Path) -> Result<(), String>) -> Result<PathBuf, String> {
    static CELLS: OnceLock<Mutex<HashMap<String, BuildCell>>> = OnceLock::new();
    let cell = CELLS.get_or_init(Default::default).lock().unwrap().entry(name.to_string()).or_default().clone();
    cell.get_or_init(|| {
        let path = work_dir().join(name);
        if path.exists() {
            return Ok(path);
        }
        let tmp = work_dir().join(format!("{name}.tmp{}", std::process::id()));
        build(&tmp)?;
        std::fs::rename(&tmp, &path).map_err(|e| e.to_string())?;
        Ok(path)
    })
    .clone()
}

/// A C++ unit, written beside `out`, that includes every `.cpp` under `dir` (the emulator's
/// runtime, the self-tests): the files keep one job each and compile in one g++ run, which
/// parses their shared headers once (a run per file takes about twice the CPU time).
fn unity_unit(dir: &Path, out: &Path) -> Result<PathBuf, String> {
    let sources: Vec<PathBuf> =
        files_under(dir).into_iter().filter(|p| p.extension().is_some_and(|e| e == "cpp")).collect();
    if sources.is_empty() {
        return Err(format!("no C++ sources (*.cpp) under {}", dir.display()));
    }
    let unit = out.with_extension("cpp");
    let text: String = sources.iter().map(|p| format!("#include \"{}\"\n", p.display())).collect();
    std::fs::write(&unit, text).map_err(|e| format!("{}: {e}", unit.display()))?;
    Ok(unit)
}

/// The emulator's runtime (every source of cuda/test/emu/runtime/, one unit) and driver objects.
fn runtime_objects() -> Result<Vec<PathBuf>, String> {
    let emu = root().join("cuda/test/emu");
    let mut objs = Vec::new();
    for name in ["runtime", "driver"] {
        let key = format!("{name}-{:016x}.o", sources_hash());
        objs.push(cached(&key, |out| {
            let src = if name == "runtime" { unity_unit(&emu.join("runtime"), out)? } else { emu.join("driver.cpp") };
            let mut a: Vec<String> = CXXFLAGS.iter().map(|s| s.to_string()).collect();
            a.extend(includes(&root().join("cuda")));
            a.extend(["-c".into(), src.display().to_string(), "-o".into(), out.display().to_string()]);
            gxx(&a, name)
        })?);
    }
    Ok(objs)
}

/// A source mutation for the mutation self-tests: in a copy of cuda/, replace `from` by `to` in
/// `file` (exactly one occurrence, or the test fails: the anchor must keep matching the kernel).
#[derive(Clone, Debug)]
pub struct Mutation {
    pub name: &'static str,
    pub file: &'static str,
    pub from: &'static str,
    pub to: &'static str,
    /// Extra compiler definitions (mutations injected in the emulator, e.g. EMU_MUTATE_DROP_TRANS_B).
    pub defines: &'static [&'static str],
}

impl Mutation {
    /// Names the mutated sources: the mutation's name and a hash of its edit and of the sources.
    fn tag(&self) -> String {
        let mut h = DefaultHasher::new();
        (self.file, self.from, self.to, self.defines, sources_hash()).hash(&mut h);
        format!("{}-{:016x}", self.name, h.finish())
    }
}

/// A copy of cuda/ with the mutation applied; returns its root.
fn mutated_tree(m: &Mutation) -> Result<PathBuf, String> {
    let dir = work_dir().join(format!("mut-{}", m.tag()));
    let cuda = dir.join("cuda");
    if !cuda.exists() {
        for f in files_under(&root().join("cuda")) {
            let rel = f.strip_prefix(root()).unwrap();
            let dst = dir.join(rel);
            std::fs::create_dir_all(dst.parent().unwrap()).unwrap();
            std::fs::copy(&f, &dst).unwrap();
        }
        if !m.file.is_empty() {
            let p = dir.join(m.file);
            let text = std::fs::read_to_string(&p).map_err(|e| format!("{}: {e}", m.file))?;
            let n = text.matches(m.from).count();
            if n != 1 {
                return Err(format!(
                    "mutation {}: {:?} occurs {n} times in {} (expected once)",
                    m.name, m.from, m.file
                ));
            }
            std::fs::write(&p, text.replacen(m.from, m.to, 1)).unwrap();
        }
    }
    Ok(cuda)
}

/// The program running the kernels of (family, tile): the unit build.rs generates, plus the
/// emulator. With a mutation, built from the mutated copy.
pub fn unit_exe(fam: &Family, tile: &Tile, mutation: Option<&Mutation>) -> Result<PathBuf, String> {
    let cuda_root = match mutation {
        Some(m) => mutated_tree(m)?,
        None => root().join("cuda"),
    };
    let tag = mutation.map_or(format!("{:016x}", sources_hash()), |m| m.tag());
    let name = format!("emu_{}_hd{}-{tag}", fam.name, tile.head_dim);
    let objs = runtime_objects()?;
    cached(&name, |out| {
        let source = cuda_root.parent().unwrap().join(fam.source());
        let mut unit = unit_source(fam, tile, &source.display().to_string(), false);
        for dt in DTYPE_NAMES {
            writeln!(unit, "EMU_KERNEL({})", kernel_symbol(fam.name, tile.head_dim, dt)).unwrap();
            if fam.name == APPEND_KV_FAMILY {
                writeln!(unit, "EMU_KERNEL({})", append_kv_symbol(tile.head_dim, dt)).unwrap();
            }
        }
        let src = out.with_extension("cpp");
        std::fs::write(&src, unit).unwrap();
        let obj = out.with_extension("o");
        let mut a: Vec<String> = CXXFLAGS.iter().map(|s| s.to_string()).collect();
        if let Some(m) = mutation {
            a.extend(m.defines.iter().map(|d| format!("-D{d}")));
        }
        // Signed overflow in the kernel's index arithmetic wraps silently on a GPU; here it is
        // an error with the file and line.
        a.extend(UBSAN.iter().map(|s| s.to_string()));
        a.extend(["-include".into(), root().join("cuda/test/emu/emu.h").display().to_string()]);
        a.extend(includes(&cuda_root));
        a.extend(["-c".into(), src.display().to_string(), "-o".into(), obj.display().to_string()]);
        gxx(&a, &format!("{} hd{}", fam.name, tile.head_dim))?;
        let mut l = vec!["-no-pie".to_string()];
        l.extend(UBSAN.iter().map(|s| s.to_string()));
        l.push(obj.display().to_string());
        l.extend(objs.iter().map(|o| o.display().to_string()));
        l.extend(["-o".into(), out.display().to_string()]);
        gxx(&l, "link")
    })
}

/// A standalone emulator program (self-tests): `src` under cuda/test/emu, a file or a directory
/// (every `.cpp` in it, one unit), with emu.h.
pub fn tool_exe(src: &str) -> Result<PathBuf, String> {
    tool_exe_with(src, None)
}

/// As [`tool_exe`], built from a copy of cuda/ with `mutation` applied when one is given (the
/// standalone kernels' mutation tests: the driver includes its kernel source relatively).
pub fn tool_exe_with(src: &str, mutation: Option<&Mutation>) -> Result<PathBuf, String> {
    let cuda_root = match mutation {
        Some(m) => mutated_tree(m)?,
        None => root().join("cuda"),
    };
    let tag = mutation.map_or(format!("{:016x}", sources_hash()), |m| m.tag());
    let objs = runtime_objects()?;
    let name = format!("{}-{tag}", src.trim_end_matches(".cpp"));
    cached(&name, |out| {
        let obj = out.with_extension("o");
        let mut a: Vec<String> = CXXFLAGS.iter().map(|s| s.to_string()).collect();
        // emu.h from the same tree as the driver, so the headers both include are one file.
        a.extend(["-include".into(), cuda_root.join("test/emu/emu.h").display().to_string()]);
        a.extend(includes(&cuda_root));
        let path = cuda_root.join("test/emu").join(src);
        let unit = if path.is_dir() { unity_unit(&path, out)? } else { path };
        a.extend(["-c".into(), unit.display().to_string(), "-o".into(), obj.display().to_string()]);
        gxx(&a, src)?;
        let mut l = vec!["-no-pie".to_string(), obj.display().to_string()];
        // The self-tests have their own main: link the runtime only.
        l.push(objs[0].display().to_string());
        l.extend(["-o".into(), out.display().to_string()]);
        gxx(&l, "link")
    })
}

/// Registers per thread at kernel entry from the ptxas report of the built image (0 when the
/// kernels were not built: the emulator then uses 65536 / threads rounded down to 8, which is
/// what `__launch_bounds__(threads, 1)` gives).
pub fn entry_regs(family: &str, head_dim: u32, kernel: &str) -> u32 {
    // The image the emulated GPU loads: the first target of the family's source.
    let Some(fam) = FAMILIES.iter().find(|f| f.name == family) else { return 0 };
    let target = targets_for(fam.source())[0];
    let Some(img) = IMAGES.iter().find(|i| i.family == family && i.head_dim == head_dim && i.target == target) else {
        return 0;
    };
    let mut in_kernel = false;
    for line in img.report.lines() {
        if line.contains("Compiling entry function") {
            in_kernel = line.contains(&format!("'{kernel}'"));
        } else if in_kernel {
            if let Some(i) = line.find("Used ") {
                if let Some(n) = line[i + 5..].split_whitespace().next().and_then(|n| n.parse().ok()) {
                    return n;
                }
            }
        }
    }
    0
}
