package loadtest

import "testing"

func TestParseCPUSet(t *testing.T) {
	tests := []struct {
		in, want string
		wantErr  bool
	}{
		{"", "", false},
		{"0", "0", false},
		{"1,0", "0-1", false},
		{"0-1,3", "0-1,3", false},
		{" 3 , 0-2,2", "0-3", false},
		{"5-7,1", "1,5-7", false},
		{"1-0", "", true},
		{"a", "", true},
		{"-1", "", true},
		{"0,", "", true},
		{"99999", "", true},
	}
	for _, tt := range tests {
		got, err := ParseCPUSet(tt.in)
		if (err != nil) != tt.wantErr || got.String() != tt.want {
			t.Errorf("ParseCPUSet(%q) = %q, %v, want %q, error %v", tt.in, got, err, tt.want, tt.wantErr)
		}
	}
}

func TestCheckCPUs(t *testing.T) {
	requireLinux(t)
	all, err := AllowedCPUs()
	if err != nil || len(all) == 0 {
		t.Fatalf("AllowedCPUs() = %s, %v, want at least one CPU", all, err)
	}
	if err := CheckCPUs("--relay-cpus", all); err != nil {
		t.Errorf("CheckCPUs(every allowed CPU %s) = %v, want nil", all, err)
	}
	if err := CheckCPUs("--relay-cpus", nil); err != nil {
		t.Errorf("CheckCPUs(none) = %v, want nil", err)
	}
	if err := CheckCPUs("--relay-cpus", CPUSet{maxCPU}); err == nil {
		t.Errorf("CheckCPUs(CPU %d) = nil, want an error", maxCPU)
	}
}
