// Test oracle: the seed's formatting code (spec_phase.rs), copied verbatim where it formats,
// driven from stdin so the Python port can be compared with the Rust output byte for byte.
// Changes from the seed, all outside the formatting: `Engine`/clocks removed; the trace
// level is a per-request static instead of the env-read OnceLock; `eprintln!` output of
// `emit` and the override line goes to stderr as in the seed and is captured by the test.
//
// Built by tests/test_rust_oracle.py with `rustc -O -C overflow-checks=off` (release
// arithmetic: u64 sums wrap, as in the serving build).
//
// Input, one request per line, fields separated by single spaces:
//   phase <tag> <tag_v> <k> <draft> <verify> <accept> <roll> <maint> <rounds> <level> <vkda> <scan> <vmla> <vffn>
//   summary <n> then n rows of: <wall_bits> <draft_bits> <verify_bits> <accept_bits> <rest_bits> <k> <j> <ctx> <seq>
//   flags <general> <alias>        (each: "N" = None, or "S" + hex of the bytes)
// Every answer (stdout and stderr) ends with a line "\x1e" on both streams.
#![allow(dead_code)]
// `.sum::<f64>()` of the seed is written `.fold(-0.0, |a, b| a + b)`: what std's float `Sum`
// is in the Rust the seed's edition 2024 needs (>= 1.85; a sum of -0.0s is -0.0), which
// Debian's rustc 1.63 (CI's) would start at +0.0.
use std::io::{BufRead, Write};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};

static LEVEL: AtomicU8 = AtomicU8::new(0);
fn spec_trace_level() -> u8 {
    LEVEL.load(Ordering::Relaxed)
}

fn parse_level(v: Option<&str>) -> Option<u8> {
    match v {
        Some("1") => Some(1),
        Some("2") => Some(2),
        _ => None,
    }
}

fn spec_trace_level_from(general: Option<&str>, glm5_alias: Option<&str>) -> u8 {
    let g = parse_level(general);
    let a = parse_level(glm5_alias);
    // The seed's `if let ... && gv != av` (a let chain, edition 2024) as nested ifs: Debian's
    // rustc (1.63, what CI installs) builds this file with edition 2021.
    if let (Some(gv), Some(av)) = (g, a) {
        if gv != av {
            eprintln!(
                "[spec-trace] MEMRA_SPEC_TRACE={gv} overrides MEMRA_GLM5_SPEC_TRACE={av} \
                 (the general flag wins; unset one to silence this)"
            );
        }
    }
    g.or(a).unwrap_or(0)
}

pub(crate) static V_KDA_NS: AtomicU64 = AtomicU64::new(0);
pub(crate) static V_KDA_SCAN_NS: AtomicU64 = AtomicU64::new(0);
pub(crate) static V_MLA_NS: AtomicU64 = AtomicU64::new(0);
pub(crate) static V_FFN_NS: AtomicU64 = AtomicU64::new(0);

#[derive(Default)]
pub(crate) struct SpecPhaseNs {
    pub(crate) draft: u64,
    pub(crate) verify: u64,
    pub(crate) accept: u64,
    pub(crate) roll: u64,
    pub(crate) maint: u64,
    pub(crate) rounds: u64,
}

impl SpecPhaseNs {
    pub(crate) fn emit(&self, tag: &str, tag_v: &str, k: usize) {
        if self.rounds == 0 {
            return;
        }
        let ms = |ns: u64| ns as f64 / 1e6;
        let per = |ns: u64| ns as f64 / 1e6 / self.rounds as f64;
        let total = self.draft + self.verify + self.accept + self.roll + self.maint;
        eprintln!(
            "[{tag}] rounds={} k={k} total={:.2}ms | draft={:.2} verify={:.2} \
             accept={:.2} roll={:.2} maint={:.2} | per-round ms: draft={:.3} verify={:.3} \
             accept={:.3} roll={:.3} maint={:.3} total={:.3}",
            self.rounds,
            ms(total),
            ms(self.draft),
            ms(self.verify),
            ms(self.accept),
            ms(self.roll),
            ms(self.maint),
            per(self.draft),
            per(self.verify),
            per(self.accept),
            per(self.roll),
            per(self.maint),
            per(total),
        );
        if spec_trace_level() >= 2 {
            let vkda = V_KDA_NS.swap(0, Ordering::Relaxed);
            let scan = V_KDA_SCAN_NS.swap(0, Ordering::Relaxed);
            let vmla = V_MLA_NS.swap(0, Ordering::Relaxed);
            let vffn = V_FFN_NS.swap(0, Ordering::Relaxed);
            let vrest = self.verify.saturating_sub(vkda + vmla);
            eprintln!(
                "[{tag_v}] rounds={} k={k} | per-round ms: vkda={:.3} (scan={:.3}) \
                 vmla={:.3} vrest={:.3} (vffn={:.3})",
                self.rounds,
                per(vkda),
                per(scan),
                per(vmla),
                per(vrest),
                per(vffn),
            );
        }
    }
}

pub const SPEC_PROF_ROUNDS: usize = 64;

#[derive(Default, Debug, Clone, Copy, PartialEq)]
pub struct SpecRoundProf {
    pub wall_ms: f32,
    pub draft_ms: f32,
    pub verify_ms: f32,
    pub accept_ms: f32,
    pub rest_ms: f32,
    pub k: u16,
    pub j: u16,
    pub ctx: u32,
    pub seq_rows: u32,
}

#[derive(Default, Debug)]
pub struct SpecRoundsLog {
    pub rounds: Vec<SpecRoundProf>,
    pub printed: usize,
    pub summarized: bool,
}

impl SpecRoundsLog {
    pub fn wants_more(&self) -> bool {
        self.rounds.len() < SPEC_PROF_ROUNDS
    }
    pub fn push(&mut self, r: SpecRoundProf) {
        if self.wants_more() {
            self.rounds.push(r);
        }
    }
    pub fn summary(&self) -> String {
        let n = self.rounds.len();
        if n == 0 {
            return "rounds=0".to_string();
        }
        let nf = n as f64;
        let k: f64 = self.rounds.iter().map(|r| r.k as f64).fold(-0.0, |a, b| a + b);
        let j: f64 = self.rounds.iter().map(|r| r.j as f64).fold(-0.0, |a, b| a + b);
        let mut walls: Vec<f32> = self.rounds.iter().map(|r| r.wall_ms).collect();
        walls.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
        let med = walls[n / 2];
        let mean = walls.iter().map(|&w| w as f64).fold(-0.0, |a, b| a + b) / nf;
        let slow = walls.iter().filter(|&&w| w > 1.5 * med).count();
        let verify_mean = self.rounds.iter().map(|r| r.verify_ms as f64).fold(-0.0, |a, b| a + b) / nf;
        let draft_mean = self.rounds.iter().map(|r| r.draft_ms as f64).fold(-0.0, |a, b| a + b) / nf;
        let seq: u64 = self.rounds.iter().map(|r| r.seq_rows as u64).sum();
        format!(
            "rounds={n} k_mean={:.2} j_mean={:.2} accept={:.3} tok_per_round={:.2} \
             wall_ms mean={:.1} min={:.1} med={:.1} max={:.1} slow_rounds(>1.5x med)={slow} \
             draft_mean={:.1} verify_mean={:.1} seq_rows_total={seq} ctx_first={} ctx_last={}",
            k / nf,
            j / nf,
            if k > 0.0 { j / k } else { 0.0 },
            (j + nf) / nf,
            mean,
            walls[0],
            med,
            walls[n - 1],
            draft_mean,
            verify_mean,
            self.rounds[0].ctx,
            self.rounds[n - 1].ctx,
        )
    }
}

fn opt(s: &str) -> Option<String> {
    if s == "N" {
        return None;
    }
    let hex = &s[1..];
    let bytes: Vec<u8> = (0..hex.len() / 2)
        .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap())
        .collect();
    Some(String::from_utf8(bytes).unwrap())
}

fn main() {
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    while let Some(Ok(line)) = lines.next() {
        let f: Vec<&str> = line.split(' ').collect();
        match f[0] {
            "phase" => {
                let n = |i: usize| f[i].parse::<u64>().unwrap();
                let p = SpecPhaseNs {
                    draft: n(4),
                    verify: n(5),
                    accept: n(6),
                    roll: n(7),
                    maint: n(8),
                    rounds: n(9),
                };
                LEVEL.store(f[10].parse().unwrap(), Ordering::Relaxed);
                V_KDA_NS.store(n(11), Ordering::Relaxed);
                V_KDA_SCAN_NS.store(n(12), Ordering::Relaxed);
                V_MLA_NS.store(n(13), Ordering::Relaxed);
                V_FFN_NS.store(n(14), Ordering::Relaxed);
                p.emit(f[1], f[2], f[3].parse().unwrap());
            }
            "summary" => {
                let cnt: usize = f[1].parse().unwrap();
                let mut log = SpecRoundsLog::default();
                for _ in 0..cnt {
                    let row = lines.next().unwrap().unwrap();
                    let g: Vec<&str> = row.split(' ').collect();
                    let b = |i: usize| f32::from_bits(g[i].parse::<u32>().unwrap());
                    log.push(SpecRoundProf {
                        wall_ms: b(0),
                        draft_ms: b(1),
                        verify_ms: b(2),
                        accept_ms: b(3),
                        rest_ms: b(4),
                        k: g[5].parse().unwrap(),
                        j: g[6].parse().unwrap(),
                        ctx: g[7].parse().unwrap(),
                        seq_rows: g[8].parse().unwrap(),
                    });
                }
                println!("{}", log.summary());
            }
            "flags" => {
                let g = opt(f[1]);
                let a = opt(f[2]);
                println!("{}", spec_trace_level_from(g.as_deref(), a.as_deref()));
            }
            _ => panic!("unknown request {line}"),
        }
        println!("\x1e");
        eprintln!("\x1e");
        std::io::stdout().flush().unwrap();
        std::io::stderr().flush().unwrap();
    }
}
