//! Launch files (driver.cpp's format): the plan's parameters and tensor maps, buffers at device
//! addresses, and the run of an emulator program on one.

use super::*;

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

/// Device addresses of the emulated buffers of a launch (16-byte aligned, 4 GiB apart): the
/// dense launches (`run_case`) and the serving tests use the same map.
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
    pub const SINKS: u64 = 0x78_0000_0000;
    /// An FP8 KV cache's k / v scales (f32).
    pub const K_SCALE: u64 = 0x7E_0000_0000;
    pub const V_SCALE: u64 = 0x7F_0000_0000;
}
