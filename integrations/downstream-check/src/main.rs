//! Uses the crate the way an engine with its own cudarc context and stream does: an `Engine` on
//! the application's context, tensors bound to the application's stream, a launch on it, and
//! the same launch on the raw `CUstream`. Only type-checked in CI (`cargo check`).

use cudarc::driver::CudaContext;
use flash_attn::cuda::{DeviceTensor, DeviceTensorMut, Engine};
use flash_attn::ForwardOptions;
use half::bf16;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let ctx = CudaContext::new(0)?;
    let stream = ctx.new_stream()?;
    let engine = Engine::from_context(ctx.clone())?;
    let shape = [1, 64, 4, 64];
    let n: usize = shape.iter().product();
    let q = stream.clone_htod(&vec![bf16::ONE; n])?;
    let mut o = stream.alloc_zeros::<bf16>(n)?;
    let opts = ForwardOptions::default().causal(true).alibi_slopes(vec![0.5f32; 4]);
    engine.prepare_alibi(&stream, &[0.5; 4])?;
    {
        let t = DeviceTensor::new(&q, &stream, shape);
        let mut out = DeviceTensorMut::new(&mut o, &stream, shape);
        let d = engine.forward(&stream, &t, &t, &t, &mut out, None, &opts)?;
        println!("{} ({})", d.kernel, d.reason);
    }
    // An engine without cudarc streams: raw addresses and a raw CUstream.
    let (qp, op) = (flash_attn_raw_ptr(&q, &stream), flash_attn_raw_ptr(&o, &stream));
    // SAFETY: q and o are live allocations of `n` bf16 in this context, ordered on `stream`.
    unsafe {
        let t = DeviceTensor::from_raw(qp, n, flash_attn::DType::BF16, shape);
        let mut out = DeviceTensorMut::from_raw(op, n, flash_attn::DType::BF16, shape);
        engine.launch_raw(stream.cu_stream(), &t, &t, &t, &mut out, None, &opts)?;
    }
    stream.synchronize()?;
    Ok(())
}

fn flash_attn_raw_ptr(s: &cudarc::driver::CudaSlice<bf16>, stream: &cudarc::driver::CudaStream) -> u64 {
    use cudarc::driver::DevicePtr;
    s.device_ptr(stream).0
}
