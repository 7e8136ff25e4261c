//! Running kernel sources in the CPU emulator (cuda/test/emu) from Rust: building one program
//! per (family, head dim) unit with g++ (cached under the target dir by a hash of every source and
//! flag), turning a problem into the crate's own launch plan (`flash_attn::cuda::plan`), writing
//! it as a launch file with the inputs, running it under several scheduler seeds, and checking the
//! outputs against the float64 reference with the GPU tests' rule.
#![allow(dead_code)]

use super::{floor_for, randn, Rng};
use flash_attn::cuda::plan::{plan, LaunchPlan, Operands, TensorMapArgs};
use flash_attn::cuda::table::{
    append_kv_symbol, kernel_symbol, APPEND_KV_FAMILY, targets_for, unit_source, Family, KernelVariant, Tile, DTYPE_NAMES, FAMILIES, IMAGES,
};
use flash_attn::reference::{attention_f64, attention_naive, max_abs_diff};
use flash_attn::{DType, Data, ForwardOptions, Problem, Tensor, TensorView, Variant};
use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex, OnceLock};

/// LSE tolerance of the GPU tests (tests/gpu/): f32 softmax statistics.
pub const LSE_TOL: f64 = 2e-3;

pub fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}
fn work_dir() -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join("emu");
    std::fs::create_dir_all(&d).unwrap();
    d
}

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
        let source = cuda_root.parent().unwrap().join(fam.source);
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
    let target = targets_for(fam.source)[0];
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

/// One emulated launch of a problem.
#[derive(Clone, Debug)]
pub struct Case {
    pub family: &'static str,
    pub dtype: DType,
    pub q: [usize; 4],
    pub k: [usize; 4],
    pub opts: ForwardOptions,
    /// Inputs are N(0, scale^2): large scales give large-magnitude scores.
    pub input_scale: f32,
    pub seeds: Vec<u64>,
    /// Persistent grid size (stage 5).
    pub sm_count: u32,
    /// Tensors laid out [b, h, s, d] in memory (strides differ from the contiguous [b, s, h, d]).
    pub bhsd: bool,
    pub label: String,
    /// The edges of the input domain (README): the softmax scale that makes the largest |q·k|
    /// this value (e.g. near f32::MAX, where log2-unit scores overflow), compared with the naive
    /// f32 softmax (a 16-bit one overflows) and LSEs relative to their size.
    pub max_score: Option<f64>,
    /// Every V set to this value (inf or NaN): rows that see no key must be exactly 0 with LSE
    /// -inf, rows that see keys non-finite.
    pub v_fill: Option<f32>,
    /// FA4's softmax rows (docs/fa4.md, "Part 1"): also compare O with the CPU backend run with
    /// the row's softmax as options (`Exp2::Poly(degree)` where the row has a share,
    /// `Rescale::Lazy { tau }` where it has a threshold), the oracle of the exponent sequence.
    pub cpu_oracle: bool,
}

impl Case {
    pub fn new(family: &'static str, dtype: DType, q: [usize; 4], k: [usize; 4], mut opts: ForwardOptions) -> Self {
        // An FA4 stage runs only when `fa4_stage` names it (its host refuses the plan otherwise):
        // ask for the row the case names, as a caller would.
        if let Some(row) = FAMILIES.iter().find(|f| f.name == family && f.variant == KernelVariant::Fa4) {
            opts.variant = Variant::Fa4;
            opts.fa4_stage = row.ladder_stage();
        }
        Case {
            family,
            dtype,
            q,
            k,
            opts,
            input_scale: 1.0,
            seeds: vec![1, 2, 3],
            sm_count: 1,
            bhsd: false,
            label: String::new(),
            max_score: None,
            v_fill: None,
            cpu_oracle: false,
        }
    }
    pub fn name(&self) -> String {
        format!(
            "{} {:?} q{:?} k{:?}{} {:?}{}{}{} sms{}{}",
            self.family,
            self.dtype,
            self.q,
            self.k,
            if self.bhsd { " [b,h,s,d]" } else { "" },
            self.opts.mask,
            self.opts.softcap.map_or(String::new(), |c| format!(" softcap{c}")),
            if self.opts.return_lse { " lse" } else { "" },
            if self.opts.alibi_slopes.is_some() { " alibi" } else { "" },
            self.sm_count,
            if self.label.is_empty() { String::new() } else { format!(" [{}]", self.label) }
        )
    }
}

/// A passing case: max error over its bound, and the emulator's log.
#[derive(Clone, Debug)]
pub struct Pass {
    pub ratio: f64,
    /// With `Case::cpu_oracle`: max |O - O_cpu| over max |O_ref| (both outputs 16-bit), in
    /// units of the dtype's epsilon.
    pub oracle_ulps: Option<f64>,
    pub log: String,
    /// The launch the run made.
    pub plan: LaunchPlan,
}
/// The outcome of one case: Ok, or Err(why, with the emulator's log).
pub type Outcome = Result<Pass, String>;

fn bits_of(t: &Tensor) -> Vec<u8> {
    match t.view().data() {
        Data::F16(s) => s.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
        Data::BF16(s) => s.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
        _ => panic!("the emulated kernels take f16/bf16"),
    }
}

/// One buffer of a launch file (driver.cpp's `in` / `out` / `inout` directives).
#[derive(Clone, Debug)]
pub struct LaunchBuf {
    pub name: String,
    /// The device address the plan's parameters use.
    pub addr: u64,
    /// `in`: these bytes; `out`: `out_bytes` read back; `inout`: these bytes, read back.
    pub data: Vec<u8>,
    pub out_bytes: usize,
    pub kind: &'static str,
}

impl LaunchBuf {
    pub fn input(name: &str, addr: u64, data: Vec<u8>) -> Self {
        LaunchBuf { name: name.into(), addr, data, out_bytes: 0, kind: "in" }
    }
    pub fn output(name: &str, addr: u64, bytes: usize) -> Self {
        LaunchBuf { name: name.into(), addr, data: Vec::new(), out_bytes: bytes, kind: "out" }
    }
    /// Read and written (a KV cache the append kernel writes into).
    pub fn inout(name: &str, addr: u64, data: Vec<u8>) -> Self {
        let n = data.len();
        LaunchBuf { name: name.into(), addr, data, out_bytes: n, kind: "inout" }
    }
    /// i32 index arrays (cu_seqlens, cache_seqlens, block_table).
    pub fn i32s(name: &str, addr: u64, v: &[i32]) -> Self {
        Self::input(name, addr, v.iter().flat_map(|x| x.to_le_bytes()).collect())
    }
}

/// Writes the launch file of `pl` with `bufs` into `dir` and runs `exe` on it under `seeds`:
/// returns the emulator's log and the bytes of every `out` / `inout` buffer by name.
pub fn run_launch(
    exe: &Path,
    dir: &Path,
    pl: &LaunchPlan,
    family: &str,
    seeds: &[u64],
    bufs: &[LaunchBuf],
) -> Result<(String, HashMap<String, Vec<u8>>), String> {
    std::fs::create_dir_all(dir).unwrap();
    let file = |n: &str| dir.join(n).display().to_string();
    let mut lf = String::new();
    writeln!(lf, "kernel {}", pl.kernel()).unwrap();
    writeln!(lf, "grid {} {} {}", pl.grid.0, pl.grid.1, pl.grid.2).unwrap();
    writeln!(lf, "block {}", pl.block.0).unwrap();
    writeln!(lf, "smem {}", pl.smem_bytes).unwrap();
    writeln!(lf, "regs {}", entry_regs(family, pl.tile.head_dim, &pl.kernel())).unwrap();
    writeln!(lf, "seeds {}", seeds.iter().map(|s| s.to_string()).collect::<Vec<_>>().join(" ")).unwrap();
    let hex: String = pl.params.to_bytes().iter().map(|b| format!("{b:02x}")).collect();
    writeln!(lf, "params {hex}").unwrap();
    writeln!(lf, "print-maps").unwrap();
    for b in bufs {
        let bytes = if b.kind == "out" {
            b.out_bytes
        } else {
            std::fs::write(file(&b.name), &b.data).unwrap();
            b.data.len()
        };
        writeln!(lf, "{} {} {:#x} {bytes} {}", b.kind, b.name, b.addr, file(&b.name)).unwrap();
    }
    for m in &pl.tensor_maps {
        writeln!(lf, "{}", tmap_directive(m)).unwrap();
    }
    std::fs::write(file("launch"), &lf).unwrap();
    let out = Command::new(exe).arg(file("launch")).output().map_err(|e| format!("run {}: {e}", exe.display()))?;
    let log = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        return Err(format!("emulator exit {:?}:\n{log}", out.status.code()));
    }
    let mut outs = HashMap::new();
    for b in bufs.iter().filter(|b| b.kind != "in") {
        outs.insert(b.name.clone(), std::fs::read(file(&b.name)).map_err(|e| format!("{}: {e}", b.name))?);
    }
    Ok((log, outs))
}

/// Runs `c` under the emulator (with `mutation` if any) and compares with the reference.
pub fn run_case(c: &Case, mutation: Option<&Mutation>) -> Outcome {
    let mut h = DefaultHasher::new();
    c.name().hash(&mut h);
    let mut rng = Rng::new(h.finish() | 1);
    let mut gen = |shape: [usize; 4]| {
        let t = randn(&mut rng, c.dtype, shape);
        if c.input_scale == 1.0 {
            t
        } else {
            let v: Vec<f32> = t.to_f32_vec().iter().map(|x| x * c.input_scale).collect();
            Tensor::from_f32(&v, c.dtype, shape).unwrap()
        }
    };
    // [b, h, s, d] storage: generate that shape, view it as [b, s, h, d] with its strides.
    let bhsd = |s: [usize; 4]| if c.bhsd { [s[0], s[2], s[1], s[3]] } else { s };
    let (q, k, mut v) = (gen(bhsd(c.q)), gen(bhsd(c.k)), gen(bhsd(c.k)));
    if let Some(x) = c.v_fill {
        v = Tensor::from_f32(&vec![x; v.numel()], c.dtype, v.shape()).unwrap();
    }
    let mut opts = c.opts.clone();
    if let Some(target) = c.max_score {
        assert!(!c.bhsd, "max_score cases use the contiguous layout");
        let ([b, sq, hq, d], [_, sk, hk, _]) = (c.q, c.k);
        let (qx, kx) = (q.to_f32_vec(), k.to_f32_vec());
        let mut max_dot = 0.0f64;
        for bi in 0..b {
            for h in 0..hq {
                for i in 0..sq {
                    let qr = &qx[((bi * sq + i) * hq + h) * d..][..d];
                    for j in 0..sk {
                        let kr = &kx[((bi * sk + j) * hk + h / (hq / hk)) * d..][..d];
                        let dot: f64 = qr.iter().zip(kr).map(|(&a, &b)| a as f64 * b as f64).sum();
                        max_dot = max_dot.max(dot.abs());
                    }
                }
            }
        }
        opts.softmax_scale = Some((target / max_dot) as f32);
    }
    fn view<'a>(t: &'a Tensor, s: [usize; 4], bhsd: bool) -> TensorView<'a> {
        if !bhsd {
            return t.view();
        }
        let st = [s[2] * s[1] * s[3], s[3], s[1] * s[3]];
        match t.view().data() {
            Data::F16(d) => TensorView::with_strides(d, s, st),
            Data::BF16(d) => TensorView::with_strides(d, s, st),
            _ => unreachable!(),
        }
    }
    let (qv, kv, vv) = (view(&q, c.q, c.bhsd), view(&k, c.k, c.bhsd), view(&v, c.k, c.bhsd));
    let p = Problem::new(&qv, &kv, &vv, &opts).map_err(|e| format!("problem: {e}"))?;
    use addr::{ALIBI, K, LSE, O, Q, V};
    let ops = Operands {
        ptrs: [Q, K, V, O],
        strides: [qv.strides(), kv.strides(), vv.strides(), qv.strides()],
        lse: if c.opts.return_lse { LSE } else { 0 },
        alibi: if c.opts.alibi_slopes.is_some() { ALIBI } else { 0 },
    };
    let pl: LaunchPlan = plan(c.family, &p, &ops, c.sm_count).map_err(|e| format!("plan: {e}"))?;
    let fam = FAMILIES.iter().find(|f| f.name == c.family).unwrap();
    let exe = unit_exe(fam, pl.tile, mutation)?;

    let dir = work_dir().join("runs").join(format!("{:016x}{}", h.finish(), mutation.map_or("", |m| m.name)));
    let n_o = c.q.iter().product::<usize>() * 2;
    let mut bufs = vec![
        LaunchBuf::input("q", Q, bits_of(&q)),
        LaunchBuf::input("k", K, bits_of(&k)),
        LaunchBuf::input("v", V, bits_of(&v)),
        LaunchBuf::output("o", O, n_o),
    ];
    let n_lse = p.batch * p.heads_q * p.seqlen_q;
    if c.opts.return_lse {
        bufs.push(LaunchBuf::output("lse", LSE, n_lse * 4));
    }
    if let Some(s) = &c.opts.alibi_slopes {
        bufs.push(LaunchBuf::input("alibi", ALIBI, s.iter().flat_map(|x| x.to_le_bytes()).collect()));
    }
    let (log, outs) = run_launch(&exe, &dir, &pl, c.family, &c.seeds, &bufs)?;
    // Outputs against the float64 reference, with the GPU tests' rule.
    let o_bytes = &outs["o"];
    let stored: Vec<f64> = o_bytes
        .chunks_exact(2)
        .map(|b| {
            let bits = u16::from_le_bytes([b[0], b[1]]);
            match c.dtype {
                DType::BF16 => half::bf16::from_bits(bits).to_f64(),
                _ => half::f16::from_bits(bits).to_f64(),
            }
        })
        .collect();
    // O has Q's strides: back to [b, s, h, d] order for the comparison.
    let [ob, os, oh, od] = c.q;
    let mut o = vec![0.0; stored.len()];
    for b in 0..ob {
        for si in 0..os {
            for h in 0..oh {
                let src = if c.bhsd { ((b * oh + h) * os + si) * od } else { ((b * os + si) * oh + h) * od };
                let dst = ((b * os + si) * oh + h) * od;
                o[dst..dst + od].copy_from_slice(&stored[src..src + od]);
            }
        }
    }
    let r = attention_f64(&p, &qv, &kv, &vv).unwrap();
    let lse_out = || -> Vec<f64> {
        let lb = &outs["lse"];
        lb.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64).collect()
    };
    if c.v_fill.is_some() {
        // Rows that see no key: exactly 0 and LSE -inf; rows that see an inf/NaN V: not finite.
        let d = p.head_dim;
        for (idx, (&got, &want)) in o.iter().zip(&r.o).enumerate() {
            let i = (idx / d / p.heads_q) % p.seqlen_q;
            let (lo, hi) = p.key_range(i);
            if lo >= hi && got != 0.0 {
                return Err(format!("row {i} sees no key but O = {got} at element {idx}\n{log}"));
            }
            if lo < hi && !want.is_finite() && got.is_finite() {
                return Err(format!("row {i} sees a non-finite V but O = {got} at element {idx}\n{log}"));
            }
        }
        if c.opts.return_lse {
            let bad = lse_out().iter().zip(&r.lse).position(|(&g, &w)| w == f64::NEG_INFINITY && g != w);
            if let Some(at) = bad {
                return Err(format!("LSE {at} of a row that sees no key is not -inf\n{log}"));
            }
        }
        return Ok(Pass { ratio: 0.0, oracle_ulps: None, log, plan: pl });
    }
    // Scores near f32::MAX: the straightforward softmax in f32 is the yardstick (in a 16-bit
    // dtype its scores overflow).
    let naive_dtype = if c.max_score.is_some() { DType::F32 } else { c.dtype };
    let naive = attention_naive(&p, &qv, &kv, &vv, naive_dtype).unwrap();
    if c.max_score.is_some() && o.iter().any(|x| !x.is_finite()) && naive.iter().all(|x| x.is_finite()) {
        return Err(format!("the naive f32 softmax is finite, the kernel's output is not\n{log}"));
    }
    let mut err = max_abs_diff(&o, &r.o);
    let bound = 2.0 * max_abs_diff(&naive, &r.o) + floor_for(c.dtype);
    if err > bound && c.max_score.is_some() {
        // Rows of a near tie may differ from the reference (near_tie_row_ok); every other row is
        // held to the bound.
        let (qx, kx, vx) = (q.to_f32_vec(), k.to_f32_vec(), v.to_f32_vec());
        let d = p.head_dim;
        let mut rest = 0.0f64;
        let mut all_ok = true;
        for (row, (got, want)) in o.chunks_exact(d).zip(r.o.chunks_exact(d)).enumerate() {
            let e = max_abs_diff(got, want);
            if e <= bound {
                rest = rest.max(e);
            } else if !near_tie_row_ok(&p, &qx, &kx, &vx, row, got, bound) {
                all_ok = false;
            }
        }
        if all_ok {
            err = rest;
        }
    }
    // max_abs_diff counts a NaN where the reference has a number as infinitely wrong.
    if err > bound {
        let worst = o.iter().zip(&r.o).enumerate().max_by(|a, b| {
            let e = |x: &(usize, (&f64, &f64))| if x.1 .0.is_nan() { f64::INFINITY } else { (x.1 .0 - x.1 .1).abs() };
            e(a).total_cmp(&e(b))
        });
        return Err(format!("max |O - ref| {err:.3e} > bound {bound:.3e} (worst at {worst:?})\n{log}"));
    }
    if c.opts.return_lse {
        let lse = lse_out();
        // Large scores: the LSE is as large, compared relative to its size and rounded to f32.
        let (lerr, tol) = match c.max_score {
            None => (max_abs_diff(&lse, &r.lse), LSE_TOL),
            Some(t) => {
                let r32: Vec<f64> = r.lse.iter().map(|&x| x as f32 as f64).collect();
                (max_abs_diff(&lse, &r32), 1e-6 * t.max(1e3))
            }
        };
        if lerr > tol {
            return Err(format!("max |LSE - ref| {lerr:.3e} > {tol:e}\n{log}"));
        }
    }
    let oracle_ulps = if c.cpu_oracle { Some(cpu_oracle_ulps(c, &opts, &qv, &kv, &vv, &o, &r.o)?) } else { None };
    Ok(Pass { ratio: err / bound, oracle_ulps, log, plan: pl })
}

/// The largest output difference the CPU oracle may show against an FA4-softmax kernel, in
/// epsilons of the 16-bit dtype at the output's scale (max |O_ref|): both round O to the dtype
/// (1 ulp each at most at that scale) and P to the dtype for the second product; the kernel
/// takes 7 of 8 (3 of 4) exponentials on MUFU (relative error 2^-22) where the oracle takes the
/// degree-3 polynomial (5e-5 relative, 0.4 bf16 / 0.05 f16 epsilon), and sums in its own order.
pub const CPU_ORACLE_ULPS: f64 = 4.0;

/// max |O - O_cpu| / (eps * max |O_ref|) for `c` against the CPU backend with the row's softmax
/// as options (see `Case::cpu_oracle`); Err when over `CPU_ORACLE_ULPS`.
fn cpu_oracle_ulps(
    c: &Case,
    opts: &ForwardOptions,
    q: &TensorView<'_>,
    k: &TensorView<'_>,
    v: &TensorView<'_>,
    o: &[f64],
    o_ref: &[f64],
) -> Result<f64, String> {
    let fam = FAMILIES.iter().find(|f| f.name == c.family).unwrap();
    let s = fam.softmax;
    let mut cpu = opts.clone().backend(flash_attn::Backend::Cpu).variant(Variant::Auto);
    cpu.fa4_stage = None;
    cpu.fa4_exp2_share = None;
    cpu = cpu.exp2(if s.poly_every > 0 { flash_attn::Exp2::Poly(s.poly_degree) } else { flash_attn::Exp2::Accurate });
    cpu = cpu.rescale(if s.lazy_tau >= 0.0 {
        flash_attn::Rescale::Lazy { threshold: s.lazy_tau }
    } else {
        flash_attn::Rescale::Always
    });
    let out = flash_attn::forward(q, k, v, &cpu).map_err(|e| format!("cpu oracle: {e}"))?;
    let got: Vec<f64> = out.o.to_f32_vec().iter().map(|&x| x as f64).collect();
    let eps = match c.dtype {
        DType::BF16 => 2f64.powi(-8),
        _ => 2f64.powi(-11),
    };
    let scale = o_ref.iter().fold(0.0f64, |m, x| if x.is_finite() { m.max(x.abs()) } else { m }).max(1e-30);
    let ulps = max_abs_diff(o, &got) / (eps * scale);
    if ulps > CPU_ORACLE_ULPS {
        return Err(format!(
            "max |O - O_cpu oracle ({:?}, {:?})| is {ulps:.2} epsilons of max |O_ref| {scale:.3e}, over {CPU_ORACLE_ULPS}",
            cpu.exp2, cpu.rescale
        ));
    }
    Ok(ulps)
}

/// Whether output row `row` ([b, s, h] order, contiguous Q/K/V as `max_score` cases use) of a
/// case with huge scores is a correct result of a near tie that the f32 scores cannot resolve.
///
/// At such scales the softmax is one-hot on the largest f32 score: two keys whose exact scores
/// differ by less than the rounding error of an f32 dot product may round to the same f32 score
/// (both get P = 1, the row is their mean) or swap, in any correct kernel, whatever its
/// summation order; the float64 reference resolves them and the naive f32 softmax, summing in
/// another order, may too. So a row is accepted when (1) distinct f32 scores near the top are
/// one-hot apart (half an ulp of the top score times scale * log2 e is past the f32 exponent
/// range: P is exactly 0 or 1), and (2) it is, within `bound`, the mean of V over a nonempty
/// subset of the keys whose exact score is within the error bounds of the top one (Higham's
/// gamma_(d+1) * sum |q_i k_i| each: d products, exact in f32 for 16-bit inputs, summed in any
/// order, and one rounding for a scale applied to the score). Found on fa3s4 F16 window (40, 8),
/// max |score| 2.5e38, row 79 head 1: keys 84 and 90 differ by 5.5e-7 (under an ulp, 1.9e-6)
/// and the wgmma summation order rounds both to 0x1.208936p+4.
fn near_tie_row_ok(p: &Problem, q: &[f32], k: &[f32], v: &[f32], row: usize, got: &[f64], bound: f64) -> bool {
    let d = p.head_dim;
    let (h, i, b) = (row % p.heads_q, (row / p.heads_q) % p.seqlen_q, row / p.heads_q / p.seqlen_q);
    let kh = h / (p.heads_q / p.heads_kv);
    let kv_row = |j: usize| ((b * p.seqlen_k + j) * p.heads_kv + kh) * d;
    let qr = &q[row * d..][..d];
    let u = f32::EPSILON as f64 / 2.0;
    let gamma = (d + 1) as f64 * u / (1.0 - (d + 1) as f64 * u);
    let (lo, hi) = p.key_range(i);
    let scores: Vec<(usize, f64, f64)> = (lo..hi)
        .map(|j| {
            let (dot, abs) = qr.iter().zip(&k[kv_row(j)..][..d]).fold((0.0, 0.0), |(s, a), (&x, &y)| {
                let t = x as f64 * y as f64;
                (s + t, a + t.abs())
            });
            (j, dot, gamma * abs)
        })
        .collect();
    let Some(&(_, top, top_err)) = scores.iter().max_by(|a, b| a.1.total_cmp(&b.1)) else { return false };
    let t32 = (top as f32).abs();
    let half_ulp = (f32::from_bits(t32.to_bits() + 1) - t32) as f64 / 2.0;
    if half_ulp * p.scale as f64 * std::f64::consts::LOG2_E < 160.0 {
        return false;
    }
    let near: Vec<usize> = scores.iter().filter(|s| top - s.1 <= top_err + s.2).map(|s| s.0).collect();
    if near.len() < 2 || near.len() > 8 {
        return false;
    }
    (1u32..1 << near.len()).any(|set| {
        let keys: Vec<usize> = (0..near.len()).filter(|&n| set >> n & 1 == 1).map(|n| near[n]).collect();
        (0..d).all(|e| {
            let mean = keys.iter().map(|&j| v[kv_row(j) + e] as f64).sum::<f64>() / keys.len() as f64;
            (got[e] - mean).abs() <= bound
        })
    })
}

/// Runs cases on up to `threads` worker threads; returns (case name, outcome) in order.
pub fn run_all(cases: &[Case], mutation: Option<&Mutation>, threads: usize) -> Vec<(String, Outcome)> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results: Mutex<Vec<(usize, String, Outcome)>> = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..threads.max(1).min(cases.len()) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(c) = cases.get(i) else { break };
                let t0 = std::time::Instant::now();
                let r = run_case(c, mutation);
                let name = format!("{} ({:.1} s)", c.name(), t0.elapsed().as_secs_f64());
                results.lock().unwrap().push((i, name, r));
            });
        }
    });
    let mut v = results.into_inner().unwrap();
    v.sort_by_key(|x| x.0);
    v.into_iter().map(|(_, n, r)| (n, r)).collect()
}

/// Device addresses of the emulated buffers of a launch (16-byte aligned, 4 GiB apart): the
/// dense launches above and the serving tests use the same map.
pub mod addr {
    pub const Q: u64 = 0x10_0000_0000;
    pub const K: u64 = 0x20_0000_0000;
    pub const V: u64 = 0x30_0000_0000;
    pub const O: u64 = 0x40_0000_0000;
    pub const LSE: u64 = 0x50_0000_0000;
    pub const ALIBI: u64 = 0x60_0000_0000;
    pub const CU_Q: u64 = 0x70_0000_0000;
    pub const CU_K: u64 = 0x71_0000_0000;
    pub const SEQUSED: u64 = 0x72_0000_0000;
    pub const TABLE: u64 = 0x73_0000_0000;
    pub const O_ACC: u64 = 0x74_0000_0000;
    pub const LSE_ACC: u64 = 0x75_0000_0000;
    pub const KNEW: u64 = 0x76_0000_0000;
    pub const VNEW: u64 = 0x77_0000_0000;
}

/// The seed of a full matrix's random configurations: `FLASH_ATTN_EMU_SEED` (a u64, or `random`
/// for a fresh one), else `fixed`, so the full matrix is reproducible and the fuzz command can
/// draw new configurations. Printed under `what`, so a failing draw can be replayed.
pub fn matrix_seed(what: &str, fixed: u64) -> u64 {
    let seed = match std::env::var("FLASH_ATTN_EMU_SEED") {
        Err(_) => fixed,
        Ok(s) if s == "random" => {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0);
            Rng::new(now ^ (std::process::id() as u64) << 32 ^ fixed).next_u64()
        }
        Ok(s) => s.parse().unwrap_or_else(|_| panic!("FLASH_ATTN_EMU_SEED={s:?}: expected a u64 or `random`")),
    };
    println!("{what}: random configurations from seed {seed} (FLASH_ATTN_EMU_SEED={seed} replays them)");
    seed
}
