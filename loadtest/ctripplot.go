package loadtest

import (
	"fmt"
	"image/color"
	"math"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
)

// writeCtripPlot draws the run's timeline to path (PNG): every sampled
// ledger push → ACK as a faint point, the P50, P99 and maximum of each
// second as lines, the targets as dashed lines, and the phases (initial
// sync, churn start and stop, all delivered) marked.
func writeCtripPlot(path string, rep *CtripReport, points []ctripPoint) error {
	p := plot.New()
	c := rep.Config
	p.Title.Text = fmt.Sprintf("loadtest ctrip: %d + %d, %d relays, %d Envoys over %d keys, churn %g/s — upstream receipt → Envoy ACK, as the relays' ledgers record it",
		c.Services, c.Endpoints, c.Relays, c.Envoys, c.Keys, c.ChurnRate)
	p.Title.TextStyle.Font.Size = vg.Points(10)
	p.X.Label.Text = "seconds since the first Envoy connected"
	// Short: a label longer than the axis makes gonum shrink the plot.
	p.Y.Label.Text = "push → ACK (ms, log)"
	p.Y.Scale = plot.LogScale{}
	p.Y.Tick.Marker = plot.LogTicks{Prec: -1}
	p.Legend.Top, p.Legend.Left = false, true
	p.Legend.XOffs, p.Legend.YOffs = vg.Points(6), vg.Points(6)
	p.Legend.TextStyle.Font.Size = vg.Points(8)

	lo, hi := math.Inf(1), 0.0
	for _, pt := range points {
		lo, hi = math.Min(lo, pt.ms), math.Max(hi, pt.ms)
	}
	if len(points) == 0 {
		lo, hi = 1, 1000
	}
	lo = math.Max(0.5, lo/1.5)
	hi = math.Max(hi*2, rep.Config.TargetP99Ms*2)
	end := 0.0
	for _, ph := range rep.Phases {
		end = math.Max(end, ph.AtS)
	}
	p.X.Min, p.X.Max = 0, math.Ceil(end*1.02+1)
	p.X.Tick.Marker = secondTicks{}
	p.Y.Min, p.Y.Max = lo, hi

	// The initial sync, shaded.
	if rep.Synced {
		sync, err := plotter.NewPolygon(plotter.XYs{{X: 0, Y: lo}, {X: rep.InitialSyncS, Y: lo}, {X: rep.InitialSyncS, Y: hi}, {X: 0, Y: hi}})
		if err != nil {
			return err
		}
		sync.Color = color.RGBA{R: 235, G: 235, B: 235, A: 255}
		sync.LineStyle.Width = 0
		p.Add(sync)
		lab, err := plotter.NewLabels(plotter.XYLabels{
			XYs:    plotter.XYs{{X: rep.InitialSyncS / 2, Y: math.Sqrt(lo * hi)}},
			Labels: []string{fmt.Sprintf("initial sync\n%d Envoys, %.0f s", c.Envoys, rep.InitialSyncS)},
		})
		if err != nil {
			return err
		}
		lab.TextStyle[0].XAlign, lab.TextStyle[0].YAlign = draw.XCenter, draw.YCenter
		lab.TextStyle[0].Font.Size = vg.Points(9)
		lab.TextStyle[0].Color = color.RGBA{R: 110, G: 110, B: 110, A: 255}
		p.Add(lab)
	}
	if len(points) > 0 {
		xys := make(plotter.XYs, len(points))
		for i, pt := range points {
			xys[i] = plotter.XY{X: pt.at, Y: pt.ms}
		}
		sc, err := plotter.NewScatter(xys)
		if err != nil {
			return err
		}
		sc.GlyphStyle.Shape = draw.CircleGlyph{}
		sc.GlyphStyle.Radius = vg.Points(0.7)
		sc.GlyphStyle.Color = color.NRGBA{R: 70, G: 110, B: 200, A: 50}
		p.Add(sc)
		p.Legend.Add(fmt.Sprintf("each ACK (%d of %d shown)", len(points), rep.Ledger.ACK.N), sc)
	}
	series := func(name string, col color.Color, width float64, val func(CtripSecond) float64) error {
		var xys plotter.XYs
		for _, s := range rep.Series {
			if v := val(s); v > 0 {
				xys = append(xys, plotter.XY{X: s.AtS + 0.5, Y: v})
			}
		}
		if len(xys) == 0 {
			return nil
		}
		l, err := plotter.NewLine(xys)
		if err != nil {
			return err
		}
		l.Color, l.Width = col, vg.Points(width)
		p.Add(l)
		p.Legend.Add(name, l)
		return nil
	}
	if err := series("max per second", color.RGBA{R: 120, G: 120, B: 120, A: 255}, 0.8, func(s CtripSecond) float64 { return s.Max }); err != nil {
		return err
	}
	if err := series("P99 per second", color.RGBA{R: 210, G: 50, B: 40, A: 255}, 1.4, func(s CtripSecond) float64 { return s.P99 }); err != nil {
		return err
	}
	if err := series("P50 per second", color.RGBA{R: 20, G: 60, B: 160, A: 255}, 1.4, func(s CtripSecond) float64 { return s.P50 }); err != nil {
		return err
	}
	// The targets.
	for _, t := range []struct {
		name string
		ms   float64
	}{{"P95 target", c.TargetP95Ms}, {"P99 target", c.TargetP99Ms}} {
		if t.ms <= 0 {
			continue
		}
		l, err := plotter.NewLine(plotter.XYs{{X: p.X.Min, Y: t.ms}, {X: p.X.Max, Y: t.ms}})
		if err != nil {
			return err
		}
		l.Color, l.Width, l.Dashes = color.RGBA{R: 200, G: 120, B: 0, A: 255}, vg.Points(0.8), []vg.Length{vg.Points(4), vg.Points(3)}
		p.Add(l)
		lab, err := plotter.NewLabels(plotter.XYLabels{XYs: plotter.XYs{{X: p.X.Min, Y: t.ms}}, Labels: []string{fmt.Sprintf(" %s %s", t.name, fmtMs(t.ms))}})
		if err != nil {
			return err
		}
		lab.TextStyle[0].XAlign, lab.TextStyle[0].YAlign = draw.XLeft, draw.YBottom
		lab.TextStyle[0].Font.Size = vg.Points(7)
		lab.TextStyle[0].Color = color.RGBA{R: 200, G: 120, B: 0, A: 255}
		p.Add(lab)
	}
	// The phases.
	for i, ph := range rep.Phases {
		if ph.AtS <= 0 {
			continue
		}
		l, err := plotter.NewLine(plotter.XYs{{X: ph.AtS, Y: lo}, {X: ph.AtS, Y: hi}})
		if err != nil {
			return err
		}
		l.Color, l.Width, l.Dashes = color.RGBA{R: 60, G: 60, B: 60, A: 255}, vg.Points(0.7), []vg.Length{vg.Points(2), vg.Points(2)}
		p.Add(l)
		// Labels alternate in height so that close phases stay readable.
		y := hi / math.Pow(1.6, float64(1+i%2))
		lab, err := plotter.NewLabels(plotter.XYLabels{XYs: plotter.XYs{{X: ph.AtS, Y: y}}, Labels: []string{" " + ph.Name}})
		if err != nil {
			return err
		}
		lab.TextStyle[0].Font.Size = vg.Points(7)
		p.Add(lab)
	}
	return p.Save(10*vg.Inch, 4.5*vg.Inch, path)
}

// secondTicks marks whole seconds: a labelled tick every 10, 30, 60, 120
// or 300 s (whichever gives at most 12), unlabelled ones between.
type secondTicks struct{}

func (secondTicks) Ticks(lo, hi float64) []plot.Tick {
	step := 10.0
	for _, s := range []float64{10, 30, 60, 120, 300, 600} {
		step = s
		if (hi-lo)/s <= 12 {
			break
		}
	}
	var out []plot.Tick
	for t := math.Ceil(lo/(step/2)) * (step / 2); t <= hi; t += step / 2 {
		label := ""
		if math.Mod(t, step) == 0 {
			label = fmt.Sprintf("%.0f", t)
		}
		out = append(out, plot.Tick{Value: t, Label: label})
	}
	return out
}
