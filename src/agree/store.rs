//! `lily agree`'s runs on disk, so that one comparison can span several processes: a full-size
//! check takes longer than one call on the GPU machine allows (the device's run, the reference in
//! f32 and the reference with bf16 activations each take minutes), and a warm machine keeps /tmp
//! between back-to-back calls. Plain little-endian binaries behind a magic word; a file of another
//! kind, version or size is an error, never a panic.

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::Path;

use anyhow::Context as _;

use super::{DeviceRun, ReferenceRun};
use crate::model::cpu::moe::RoutingStats;
use crate::model::RoutingTrace;

const RUN_MAGIC: &[u8; 8] = b"LILYRUN1";
const REFERENCE_MAGIC: &[u8; 8] = b"LILYREF1";

/// What a saved device run holds besides the run: the device's name and the prompt's length.
#[derive(Debug, Clone, PartialEq)]
pub struct SavedRun {
    pub device: String,
    pub prompt_tokens: usize,
    pub run: DeviceRun,
}

pub fn save_run(path: &Path, saved: &SavedRun) -> anyhow::Result<()> {
    let mut w = Writer::create(path, RUN_MAGIC)?;
    w.bytes(saved.device.as_bytes())?;
    w.u64(saved.prompt_tokens as u64)?;
    w.u64(saved.run.steps.len() as u64)?;
    for (token, logits) in &saved.run.steps {
        w.u64(*token as u64)?;
        w.f32s(logits)?;
    }
    match &saved.run.routing {
        None => w.u64(0)?,
        Some(trace) => {
            w.u64(1)?;
            w.u64(trace.logits.len() as u64)?;
            for (logits, experts) in trace.logits.iter().zip(&trace.experts) {
                w.f32s(logits)?;
                w.u32s(experts)?;
            }
        }
    }
    w.finish()
}

pub fn load_run(path: &Path) -> anyhow::Result<SavedRun> {
    let mut r = Reader::open(path, RUN_MAGIC)?;
    let device = String::from_utf8(r.bytes()?).context("device name is not UTF-8")?;
    let prompt_tokens = r.number()?;
    let steps = (0..r.len()?)
        .map(|_| Ok((r.u32()?, r.f32s()?)))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let routing = match r.u64()? {
        0 => None,
        1 => {
            let layers = r.len()?;
            let mut trace = RoutingTrace::default();
            for _ in 0..layers {
                trace.logits.push(r.f32s()?);
                trace.experts.push(r.u32s()?);
            }
            Some(trace)
        }
        other => anyhow::bail!("{}: bad routing flag {other}", path.display()),
    };
    r.end()?;
    Ok(SavedRun {
        device,
        prompt_tokens,
        run: DeviceRun { steps, routing },
    })
}

pub fn save_reference(path: &Path, reference: &ReferenceRun) -> anyhow::Result<()> {
    let mut w = Writer::create(path, REFERENCE_MAGIC)?;
    w.f32s(&reference.logits)?;
    match &reference.routing {
        None => w.u64(0)?,
        Some(layers) => {
            w.u64(1)?;
            w.u64(layers.len() as u64)?;
            for l in layers {
                w.u64(l.rows as u64)?;
                w.u64(l.flipped as u64)?;
                w.u64(l.inconsistent as u64)?;
                w.f32s(&[l.largest_distance, l.largest_flip_margin])?;
            }
        }
    }
    w.finish()
}

/// A saved reference run; its logits must be `values` long (the compared positions × vocab).
pub fn load_reference(path: &Path, values: usize) -> anyhow::Result<ReferenceRun> {
    let mut r = Reader::open(path, REFERENCE_MAGIC)?;
    let logits = r.f32s()?;
    anyhow::ensure!(
        logits.len() == values,
        "{}: {} logits, this comparison has {values}",
        path.display(),
        logits.len()
    );
    let routing = match r.u64()? {
        0 => None,
        1 => {
            let layers = r.len()?;
            let mut stats = Vec::with_capacity(layers.min(1024));
            for _ in 0..layers {
                let (rows, flipped, inconsistent) = (r.number()?, r.number()?, r.number()?);
                let f = r.f32s()?;
                anyhow::ensure!(f.len() == 2, "{}: bad routing record", path.display());
                stats.push(RoutingStats {
                    rows,
                    flipped,
                    inconsistent,
                    largest_distance: f[0],
                    largest_flip_margin: f[1],
                });
            }
            Some(stats)
        }
        other => anyhow::bail!("{}: bad routing flag {other}", path.display()),
    };
    r.end()?;
    Ok(ReferenceRun { logits, routing })
}

struct Writer {
    out: BufWriter<File>,
}

impl Writer {
    fn create(path: &Path, magic: &[u8; 8]) -> anyhow::Result<Self> {
        let file = File::create(path).with_context(|| format!("creating {}", path.display()))?;
        let mut out = BufWriter::new(file);
        out.write_all(magic)?;
        Ok(Writer { out })
    }
    fn u64(&mut self, v: u64) -> anyhow::Result<()> {
        Ok(self.out.write_all(&v.to_le_bytes())?)
    }
    fn bytes(&mut self, b: &[u8]) -> anyhow::Result<()> {
        self.u64(b.len() as u64)?;
        Ok(self.out.write_all(b)?)
    }
    fn f32s(&mut self, v: &[f32]) -> anyhow::Result<()> {
        self.u64(v.len() as u64)?;
        v.iter()
            .try_for_each(|x| self.out.write_all(&x.to_le_bytes()))?;
        Ok(())
    }
    fn u32s(&mut self, v: &[u32]) -> anyhow::Result<()> {
        self.u64(v.len() as u64)?;
        v.iter()
            .try_for_each(|x| self.out.write_all(&x.to_le_bytes()))?;
        Ok(())
    }
    fn finish(mut self) -> anyhow::Result<()> {
        Ok(self.out.flush()?)
    }
}

struct Reader {
    input: BufReader<File>,
    /// Bytes left in the file: no length read from it may ask for more.
    left: u64,
    path: String,
}

impl Reader {
    fn open(path: &Path, magic: &[u8; 8]) -> anyhow::Result<Self> {
        let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
        let left = file.metadata()?.len();
        let mut r = Reader {
            input: BufReader::new(file),
            left,
            path: path.display().to_string(),
        };
        let mut m = [0u8; 8];
        r.fill(&mut m)?;
        anyhow::ensure!(
            &m == magic,
            "{} is not a lily agree {} file",
            r.path,
            if magic == RUN_MAGIC {
                "device run"
            } else {
                "reference"
            }
        );
        Ok(r)
    }
    fn fill(&mut self, buf: &mut [u8]) -> anyhow::Result<()> {
        anyhow::ensure!(
            buf.len() as u64 <= self.left,
            "{} ends early (truncated?)",
            self.path
        );
        self.input.read_exact(buf)?;
        self.left -= buf.len() as u64;
        Ok(())
    }
    fn u64(&mut self) -> anyhow::Result<u64> {
        let mut b = [0u8; 8];
        self.fill(&mut b)?;
        Ok(u64::from_le_bytes(b))
    }
    /// A plain number (not a count of what follows).
    fn number(&mut self) -> anyhow::Result<usize> {
        let v = self.u64()?;
        usize::try_from(v).map_err(|_| anyhow::anyhow!("{}: {v} is out of range", self.path))
    }
    /// A count of items of at least one byte each: never more than the bytes left.
    fn len(&mut self) -> anyhow::Result<usize> {
        let n = self.u64()?;
        anyhow::ensure!(n <= self.left, "{}: a count of {n} past the end", self.path);
        Ok(n as usize)
    }
    fn u32(&mut self) -> anyhow::Result<u32> {
        let v = self.u64()?;
        u32::try_from(v).map_err(|_| anyhow::anyhow!("{}: {v} is not a token id", self.path))
    }
    fn bytes(&mut self) -> anyhow::Result<Vec<u8>> {
        let n = self.len()?;
        let mut b = vec![0u8; n];
        self.fill(&mut b)?;
        Ok(b)
    }
    fn words(&mut self) -> anyhow::Result<Vec<[u8; 4]>> {
        let n = self.len()?;
        anyhow::ensure!(
            n as u64 * 4 <= self.left,
            "{}: {n} values past the end",
            self.path
        );
        let mut b = vec![0u8; n * 4];
        self.fill(&mut b)?;
        Ok(b.chunks_exact(4)
            .map(|c| [c[0], c[1], c[2], c[3]])
            .collect())
    }
    fn f32s(&mut self) -> anyhow::Result<Vec<f32>> {
        Ok(self.words()?.into_iter().map(f32::from_le_bytes).collect())
    }
    fn u32s(&mut self) -> anyhow::Result<Vec<u32>> {
        Ok(self.words()?.into_iter().map(u32::from_le_bytes).collect())
    }
    fn end(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.left == 0,
            "{}: {} bytes after the end",
            self.path,
            self.left
        );
        Ok(())
    }
}
