// AudioWorklet: the microphone (float32 blocks of 128 at the AudioContext's rate, first channel)
// -> mono PCM16 frames of `frameMs` at `targetRate` (the Realtime session's declared rate),
// posted to the page as transferred ArrayBuffers (little-endian Int16, as every platform
// running a browser stores it).
//
// Resampling: a band-limited interpolator (windowed sinc, Kaiser window beta 8.6, 16 zero
// crossings of the filter at its cutoff, 92 % of the lower of the two Nyquist frequencies; the
// kernel tabulated at 1/512 input sample, linearly interpolated). Output sample n sits at input
// time n * inRate / targetRate: no delay beyond the filter's look-ahead (16 zero crossings).
// Equal rates pass samples through unchanged.

const ZEROS = 16;
const RES = 512;
const BETA = 8.6;

function besselI0(x) {
  let sum = 1, term = 1;
  for (let k = 1; k < 40; k++) {
    term *= (x / (2 * k)) ** 2;
    sum += term;
    if (term < 1e-12 * sum) break;
  }
  return sum;
}

class StreamResampler {
  constructor(inRate, outRate) {
    this.same = inRate === outRate;
    this.step = inRate / outRate;               // input samples per output sample
    const fc = 0.92 * Math.min(1, outRate / inRate); // cutoff, as a fraction of the input Nyquist
    this.half = Math.ceil(ZEROS / fc);          // kernel half-width in input samples
    const n = this.half * RES + 2;
    this.table = new Float32Array(n);
    const i0b = besselI0(BETA);
    for (let i = 0; i < n; i++) {
      const t = i / RES;
      const x = t / this.half;
      const sinc = t === 0 ? 1 : Math.sin(Math.PI * fc * t) / (Math.PI * fc * t);
      this.table[i] = x >= 1 ? 0 : fc * sinc * besselI0(BETA * Math.sqrt(1 - x * x)) / i0b;
    }
    this.buf = new Float32Array(8192);
    this.len = this.half;   // `half` zeros before the first input sample
    this.pos = this.half;   // buffer position of the next output sample
  }

  kernel(d) {
    const x = Math.abs(d) * RES;
    const i = x | 0;
    if (i >= this.table.length - 1) return 0;
    return this.table[i] + (x - i) * (this.table[i + 1] - this.table[i]);
  }

  /** Feed `x` (Float32Array); calls `out(sample)` for each output sample now computable. */
  push(x, out) {
    if (this.same) { for (let i = 0; i < x.length; i++) out(x[i]); return; }
    if (this.len + x.length > this.buf.length) {
      const b = new Float32Array(2 * (this.len + x.length));
      b.set(this.buf.subarray(0, this.len));
      this.buf = b;
    }
    this.buf.set(x, this.len);
    this.len += x.length;
    const h = this.half, buf = this.buf;
    while (this.pos + h < this.len) {
      const p = this.pos;
      let acc = 0;
      for (let k = Math.ceil(p - h), end = Math.floor(p + h); k <= end; k++) acc += buf[k] * this.kernel(p - k);
      out(acc);
      this.pos += this.step;
    }
    const drop = Math.floor(this.pos - h);
    if (drop > 0) {
      buf.copyWithin(0, drop, this.len);
      this.len -= drop;
      this.pos -= drop;
    }
  }
}

class PcmFrames extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const o = options.processorOptions || {};
    this.rs = new StreamResampler(sampleRate, o.targetRate);
    this.size = Math.round((o.targetRate * (o.frameMs || 20)) / 1000);
    this.frame = new Int16Array(this.size);
    this.n = 0;
    this.running = true;
    this.emit = (v) => {
      const c = v > 1 ? 1 : v < -1 ? -1 : v;
      this.frame[this.n++] = Math.round(c < 0 ? c * 32768 : c * 32767);
      if (this.n === this.size) this.post();
    };
    this.port.onmessage = (e) => {
      if (e.data === "stop") { if (this.n) this.post(); this.running = false; this.port.postMessage("stopped"); }
    };
  }

  post() {
    const f = this.n === this.size ? this.frame : this.frame.slice(0, this.n);
    this.port.postMessage(f.buffer, [f.buffer]);
    this.frame = new Int16Array(this.size);
    this.n = 0;
  }

  process(inputs) {
    const ch = inputs[0] && inputs[0][0];
    if (this.running && ch) this.rs.push(ch, this.emit);
    return this.running;
  }
}

registerProcessor("pcm-frames", PcmFrames);
